"""Recipes: YAML + dotted overrides -> a validated :class:`RunConfig`, before any work starts."""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

import attrs
import yaml

from rlcore.config.schema import RunConfig
from rlcore.config.structure import MOVED_KEYS, ConfigError, RawText, set_dotted, structure, unknown_key_error, unstructure
from rlcore.plugins import SHARED_SECTION_KEYS, PluginManager, get_plugin_manager


def parse_override(item: str) -> tuple[list[str], RawText | None]:
    """``dotted.key=value`` sets a key; ``~dotted.key`` removes one the recipe sets (value None)."""
    if item.startswith("~"):
        key = item[1:].strip()
        if not key or "=" in key or any(not part for part in key.split(".")):
            raise ConfigError(key or item, f"override {item!r}: a removal looks like ~dotted.key, with no value")
        return key.split("."), None
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(key or item, f"override {item!r} must look like dotted.key=value (or ~dotted.key to remove a key)")
    return key.split("."), RawText(value)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None and value is None:
                raise ConfigError(".".join(parts), f"cannot remove it ({item!r}): the recipe does not set {'.'.join(parts[: i + 1])}")
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), f"is a value ({child!r}), not a section; cannot set {item!r}")
            node = child
        if value is None:
            if parts[-1] not in node:
                raise ConfigError(".".join(parts), f"cannot remove it ({item!r}): the recipe does not set it")
            del node[parts[-1]]
        else:
            node[parts[-1]] = value
    return data


def _section_resolver(manager: PluginManager):
    def resolve(path: str, value: Any) -> Any:
        regs = manager.by_section(path)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        key = SHARED_SECTION_KEYS.get(path)
        if key is not None:
            chosen = value.get(key)
            if isinstance(chosen, RawText):
                chosen = chosen.text
            if chosen is None:
                raise ConfigError(f"{path}.{key}", f"required: one of {sorted(r.name for r in regs)}")
            match = [r for r in regs if r.name == chosen]
            if not match:
                names = sorted(r.name for r in regs)
                close = difflib.get_close_matches(str(chosen), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{path}.{key}", f"no installed plugin provides {chosen!r} (installed: {', '.join(names)}){hint}")
            reg = match[0]
        else:
            reg = regs[0]
        if reg.config_cls is None:
            if value:
                raise unknown_key_error(path, next(iter(value)), [])
            return None
        try:
            return structure(reg.config_cls, value, path)
        except ConfigError as err:
            raise _with_other_provider_hint(err, path, key, reg.name, regs) from None

    return resolve


def _with_other_provider_hint(err: ConfigError, path: str, key: str | None, chosen: str, regs) -> ConfigError:
    """An unknown key that another provider of the shared section takes: say whose it is and how to drop it."""
    prefix = f"{path}."
    name = err.key[len(prefix):] if err.key.startswith(prefix) else ""
    if key is None or not name or "." in name or not err.message.startswith("unknown key"):
        return err
    owners = [r.name for r in regs if r.name != chosen and r.config_cls is not None and name in attrs.fields_dict(r.config_cls)]
    if not owners:
        return err
    return ConfigError(err.key, f"{err.message} (a key of {path}.{key}={owners[0]}, not of {chosen}: "
                                f"remove it from the recipe, or add the override ~{err.key})")


def build_config(data: dict, overrides: list[str] = (), manager: PluginManager | None = None) -> RunConfig:
    """Validate a recipe given as a dict (plus overrides) into a :class:`RunConfig`."""
    manager = manager or get_plugin_manager()
    data = apply_overrides(data or {}, list(overrides))
    resolver = _section_resolver(manager)
    sections = {path: resolver for path in manager.sections()}
    found: dict[str, Any] = {}
    config = structure(RunConfig, data, "", sections, found)
    # Sections the recipe leaves out still get their schema's defaults (if it has any).
    for path in sections:
        if path not in found and path not in SHARED_SECTION_KEYS:
            regs = manager.by_section(path)
            if regs[0].config_cls is not None:
                try:
                    found[path] = structure(regs[0].config_cls, {}, path)
                except ConfigError:
                    pass  # required keys without defaults: absent means "not used"
    return RunConfig(
        policy=config.policy, train=config.train, grpo=config.grpo, cluster=config.cluster,
        checkpointing=config.checkpointing, env=config.env, logger=config.logger, experimental=config.experimental,
        sections=found,
    )


def upgrade_saved_config(data: dict) -> dict:
    """A run's saved config (a checkpoint's copy, a run directory's ``config.yaml``) written by an
    older rlcore, with its moved keys (:data:`~rlcore.config.structure.MOVED_KEYS`) at their new
    places. A recipe is never upgraded: there the old spelling is an error naming the new one."""
    data = copy.deepcopy(data)
    for old, new in MOVED_KEYS.items():
        *old_parents, old_leaf = old.split(".")
        node = data
        for part in old_parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or old_leaf not in node:
            continue
        value = node.pop(old_leaf)
        *new_parents, new_leaf = new.split(".")
        target = data
        for part in new_parents:
            target = target.setdefault(part, {})
        target.setdefault(new_leaf, value)
    return data


class _RecipeLoader(yaml.SafeLoader):
    """Safe YAML that refuses what a recipe never needs and only ever hides a mistake: a key given
    twice in one mapping (YAML keeps the last, silently), and aliases (``*name``), which are
    expanded into the resolved config each time they are used (a small file can expand to
    gigabytes)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError("", f"line {event.start_mark.line + 1}: YAML alias *{event.anchor} is not allowed in a "
                              "recipe; write the values out (or use a dotted override)")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (list, dict)):  # YAML's complex key (`? [a, b]`): no recipe key is one
                raise ConfigError("", f"line {line}: a key that is a YAML {'sequence' if isinstance(key, list) else 'mapping'} "
                                  f"({str(key)[:60]}); a recipe's keys are names")
            if key in seen:
                raise ConfigError(str(key), f"given twice in one mapping (lines {seen[key]} and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_recipe_yaml(path: Path) -> Any:
    """A recipe file's YAML: UTF-8 text, no duplicate keys, no aliases (errors name the file and line)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError("", f"{path}: not a UTF-8 text file (byte 0x{raw[exc.start]:02x} on line {line}); a recipe "
                          "is YAML text") from None
    if "\x00" in text:
        raise ConfigError("", f"{path}: holds NUL bytes; a recipe is YAML text, not a binary file")
    try:
        return yaml.load(text, Loader=_RecipeLoader) or {}  # noqa: S506 - a SafeLoader subclass
    except ConfigError as exc:
        raise ConfigError(exc.key, f"{path}: {exc.message}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path}: invalid YAML: {exc}") from exc


def load_config(path: str | os.PathLike, overrides: list[str] = (), manager: PluginManager | None = None) -> RunConfig:
    """Read a YAML recipe, apply ``a.b.c=value`` overrides and validate it all."""
    path = Path(path)
    if not path.is_file():
        from rlcore.loading.shipped import shipped_recipe

        shipped = shipped_recipe(path)  # a name, or the documentation's recipes/NAME.yaml outside a checkout
        if shipped is None:
            raise ConfigError("", f"recipe not found: {path} (`rlcore recipes` lists the recipes that ship with rlcore, "
                              "by name)")
        path = shipped
    data = read_recipe_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: a recipe must be a mapping at the top level")
    try:
        return build_config(data, overrides, manager)
    except ConfigError as exc:
        raise ConfigError(exc.key, f"{exc.message} (in {path})") from exc


def to_dict(config: RunConfig) -> dict:
    """The resolved config as one nested dict, plugin sections at their paths."""
    out = unstructure(config)
    for path, value in out.pop("sections").items():
        set_dotted(out, path, value)
    return out
