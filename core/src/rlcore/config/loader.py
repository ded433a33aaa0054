"""Recipes: YAML + dotted overrides -> a validated :class:`RunConfig`, before any work starts."""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from rlcore.config.schema import RunConfig
from rlcore.config.structure import ConfigError, RawText, structure, unknown_key_error, unstructure
from rlcore.plugins import SHARED_SECTION_KEYS, PluginManager, get_plugin_manager


def parse_override(item: str) -> tuple[list[str], RawText]:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(key or item, f"override {item!r} must look like dotted.key=value")
    return key.split("."), RawText(value)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), f"is a value ({child!r}), not a section; cannot set {item!r}")
            node = child
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
        return structure(reg.config_cls, value, path)

    return resolve


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
        policy=config.policy, grpo=config.grpo, cluster=config.cluster, checkpointing=config.checkpointing,
        env=config.env, logger=config.logger, experimental=config.experimental, sections=found,
    )


def load_config(path: str | os.PathLike, overrides: list[str] = (), manager: PluginManager | None = None) -> RunConfig:
    """Read a YAML recipe, apply ``a.b.c=value`` overrides and validate it all."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("", f"recipe not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: a recipe must be a mapping at the top level")
    try:
        return build_config(data, overrides, manager)
    except ConfigError as exc:
        raise ConfigError(exc.key, f"{exc.message} (in {path})") from exc


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """``tree["a"]["b"]["c"] = value`` for ``dotted == "a.b.c"``, creating missing levels."""
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def to_dict(config: RunConfig) -> dict:
    """The resolved config as one nested dict, plugin sections at their paths."""
    out = unstructure(config)
    for path, value in out.pop("sections").items():
        set_dotted(out, path, value)
    return out
