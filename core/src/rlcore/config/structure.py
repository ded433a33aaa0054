"""Turn nested dicts (YAML + overrides) into frozen attrs configs, naming the key on any error.

Hand-written rather than cattrs because the error is the product here: every failure names the
full dotted key path (``policy.megatron_cfg.tensor_model_parallel_sise``) and, for an unknown
key, the closest valid one. Supported field types: bool, int, float, str, ``X | None``,
``Literal[...]``, ``tuple[X, ...]``, ``list[X]``, ``dict[str, X]``, ``Any`` and nested attrs
classes. Values that came from the command line arrive as :class:`RawText` and are parsed by
the type of the field they land in.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from typing import Any, Literal, Union

import attrs
import yaml


class ConfigError(ValueError):
    """Invalid configuration. ``key`` is the full dotted path of the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"config key '{key}': {message}" if key else message)


@attrs.frozen
class RawText:
    """A command-line value, parsed only once the target field's type is known."""

    text: str


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """``tree["a"]["b"]["c"] = value`` for ``dotted == "a.b.c"``, creating missing levels."""
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


# Sections of rlcore's own plugin distributions, to say what to install when one is missing.
SECTION_PROVIDERS = {
    "policy.dtensor_cfg": "rlcore-fsdp2",
    "policy.megatron_cfg": "rlcore-megatron",
    "policy.generation": "rlcore-vllm (or the built-in 'hf' generator)",
    "env.math": "rlcore-math",
    "env.math_tool": "rlcore-math",
    "data": "rlcore-math (or another dataset plugin)",
}


# Keys that moved to another section (old dotted key -> new): a recipe or override with the old
# spelling is an error naming both, and a run's saved config is read with them moved
# (rlcore.loading.loader.upgrade_saved_config). The keys every trainer reads left ``grpo`` for ``train``.
MOVED_KEYS = {f"grpo.{key}": f"train.{key}" for key in (
    "max_num_steps", "num_prompts_per_step", "val_period", "val_at_start", "max_val_samples", "seed", "deterministic",
    "max_consecutive_nonfinite")}
MOVED_TO = {"train": "what every trainer reads: steps, prompts per step, validation, seed, the non-finite limit"}


def moved_keys_error(path: str, keys: list[str]) -> ConfigError:
    """The error for old spellings (:data:`MOVED_KEYS`) given in one mapping: the first names the
    key, and every one of them is listed with its new place, so one run of the check fixes all."""
    old = [join(path, key) for key in keys]
    new = MOVED_KEYS[old[0]]
    section = new.split(".")[0]
    others = "; likewise " + ", ".join(f"{o} -> {MOVED_KEYS[o]}" for o in old[1:]) if len(old) > 1 else ""
    return ConfigError(old[0], f"moved: write '{new}' instead{others} (section '{section}' holds "
                       f"{MOVED_TO.get(section, 'these keys now')})")


def unknown_key_error(path: str, key: str, valid: list[str]) -> ConfigError:
    if join(path, key) in MOVED_KEYS:
        return moved_keys_error(path, [key])
    provider = SECTION_PROVIDERS.get(join(path, key))
    if provider is not None:
        return ConfigError(join(path, key), f"no installed plugin provides this section; install {provider} (and check RLCORE_DISABLE_PLUGINS)")
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"; did you mean '{join(path, close[0])}'?" if close else f"; valid keys here: {', '.join(sorted(valid))}"
    return ConfigError(join(path, key), f"unknown key{hint}")


def field_doc(field: attrs.Attribute) -> str:
    return field.metadata.get("doc", "")


def doc(text: str) -> dict:
    """Field metadata carrying its one-line documentation: ``attrs.field(metadata=doc(...))``."""
    return {"doc": text}


SectionResolver = typing.Callable[[str, Any], Any]


# A field of this name (internal, derived) receives the keys the recipe gave the section: a schema's way
# to tell a value the user chose from its default.
EXPLICIT_KEYS = "explicit_keys"


def structure(cls: type, data: Any, path: str = "", sections: dict[str, SectionResolver] | None = None, found: dict | None = None) -> Any:
    """Build ``cls`` (an attrs class) from ``data`` (a mapping), validating every key.

    ``sections`` maps dotted paths owned by plugins (``policy.megatron_cfg``) to resolvers that
    structure them with the plugin's schema; their results go into ``found`` by path instead of
    into ``cls``. Unknown keys are errors that suggest the closest field or plugin section.
    """
    sections = sections or {}
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping for {cls.__name__}, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls) if not f.metadata.get("internal")}
    prefix = f"{path}." if path else ""
    here = {p[len(prefix) :]: p for p in sections if p.startswith(prefix) and "." not in p[len(prefix) :]}
    moved = [str(key) for key in data if key not in fields and join(path, str(key)) in MOVED_KEYS]
    if moved:
        raise moved_keys_error(path, moved)
    for key in data:
        if key not in fields and key not in here:
            raise unknown_key_error(path, str(key), list(fields) + list(here))
    kwargs = {}
    for key, value in data.items():
        if key in here and key not in fields:
            assert found is not None, "plugin sections need a 'found' dict"
            found[here[key]] = sections[here[key]](here[key], value)
    for name, field in fields.items():
        if name in data:
            tp = hints.get(name, Any)
            if attrs.has(tp):
                kwargs[name] = structure(tp, data[name], join(path, name), sections, found)
            else:
                kwargs[name] = convert(tp, data[name], join(path, name))
        elif field.default is attrs.NOTHING:
            raise ConfigError(join(path, name), f"required key is missing ({field_doc(field) or 'no default'})")
    if EXPLICIT_KEYS in attrs.fields_dict(cls):  # a schema that asks which keys the recipe set (layout: auto)
        kwargs[EXPLICIT_KEYS] = frozenset(data)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(_failing_field(path, exc, kwargs), str(exc)) from exc


def _failing_field(path: str, exc: Exception, kwargs: dict) -> str:
    """The dotted path of the field a validator rejected: attrs' messages start with "'name' ...",
    hand-written ones by convention with "name ..."."""
    message = str(exc.args[0]) if exc.args else ""
    for name in kwargs:
        if message.startswith((f"'{name}'", f"{name} ")):
            return join(path, name)
    return path


def _parse_raw(tp: Any, raw: RawText, path: str) -> Any:
    text = raw.text
    if tp is str:
        return text
    if tp is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise ConfigError(path, f"expected true/false, got {text!r}")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(path, f"cannot parse {text!r}: {exc}") from exc


def convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if isinstance(value, RawText):
        if origin in (Union, types.UnionType):
            non_none = [a for a in args if a is not type(None)]
            if value.text.strip().lower() in ("null", "none", "~"):
                return None
            if len(non_none) == 1:
                return convert(non_none[0], value, path)
            for arg in non_none:  # the command line's text read as each member in turn ("auto" for float | "auto")
                try:
                    return convert(arg, value, path)
                except ConfigError:
                    continue
            raise ConfigError(path, f"value {value.text!r} does not match {_type_name(tp)}")
        value = _parse_raw(tp, value, path)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:  # "X | None": X's own error (key path, closest key) is the useful one
            return convert(non_none[0], value, path)
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return convert(arg, value, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(path, f"value {value!r} does not match {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(path, f"must be one of {list(args)}, got {value!r}{hint}")
        return value
    if attrs.has(tp):
        return structure(tp, value, path)
    if origin in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(path, f"expected {len(args)} items, got {len(value)}")
            return tuple(convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        item = args[1] if len(args) == 2 else Any
        return {k: convert(item, v, join(path, str(k))) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):  # YAML reads "1e-5" as a string
                try:
                    value = float(value)
                except ValueError:
                    raise ConfigError(path, f"expected a number, got {value!r}") from None
            else:
                raise ConfigError(path, f"expected a number, got {value!r}")
        # No setting means anything at NaN or infinity: such a value only ever fails later, or
        # silently turns a feature off (clipping at a NaN norm, a reward of NaN).
        if not math.isfinite(float(value)):
            raise ConfigError(path, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def unstructure(obj: Any) -> Any:
    """attrs config -> plain dicts/lists (for printing and saving the resolved config)."""
    if attrs.has(type(obj)):
        return {f.name: unstructure(getattr(obj, f.name)) for f in attrs.fields(type(obj)) if f.name != EXPLICIT_KEYS}
    if isinstance(obj, dict):
        return {k: unstructure(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [unstructure(v) for v in obj]
    return obj
