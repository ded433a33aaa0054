"""The defaults ``rlcore run`` applies to what a recipe leaves out (``rlcore config --defaults``).

The core's keys come from :class:`rlcore.config.RunConfig`; each installed plugin's section from
its registered schema. A section several plugins share (``algorithm``, ``data``,
``policy.generation``) has one set of defaults per provider, chosen in a recipe by its ``name`` or
``backend`` key. Read from the schemas' field defaults (no section is built, so a key without a
default shows as ``<required>``). Imports no torch.
"""

from __future__ import annotations

from typing import Any

import attrs

from rlcore.config.schema import RunConfig

REQUIRED = "<required>"


def field_defaults(cls: type) -> dict[str, Any]:
    """Each field of the attrs class ``cls`` with its default (nested configs expanded)."""
    from rlcore.config.structure import unstructure

    out: dict[str, Any] = {}
    for f in attrs.fields(attrs.resolve_types(cls)):
        if f.metadata.get("internal"):
            continue
        default = f.default
        if default is attrs.NOTHING:
            out[f.name] = field_defaults(f.type) if isinstance(f.type, type) and attrs.has(f.type) else REQUIRED
            continue
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory(None) if default.takes_self else default.factory()
        out[f.name] = unstructure(default)
    return out


def run_defaults(manager: Any) -> dict[str, Any]:
    """``{"core": {...}, "sections": [{path, kind, name, distribution, defaults}, ...]}``."""
    sections = []
    for reg in manager.iter_registrations():
        if reg.section is None or reg.config_cls is None or not attrs.has(reg.config_cls):
            continue
        sections.append({"path": reg.section, "kind": reg.kind, "name": reg.name,
                         "distribution": reg.source.distribution, "defaults": field_defaults(reg.config_cls)})
    return {"core": field_defaults(RunConfig), "sections": sections}


def format_defaults(defaults: dict[str, Any]) -> str:
    """YAML for people: the core's keys, then each plugin section nested at its path."""
    import yaml

    from rlcore.config.structure import set_dotted

    def dump(tree: dict) -> str:
        return yaml.safe_dump(tree, sort_keys=False, default_flow_style=None)

    parts = ["# rlcore run: the defaults of every key a recipe leaves out", dump(defaults["core"])]
    for section in defaults["sections"]:
        tree: dict[str, Any] = {}
        set_dotted(tree, section["path"], section["defaults"])
        parts.append(f"# {section['path']}: {section['kind']} '{section['name']}' ({section['distribution']})")
        parts.append(dump(tree))
    return "\n".join(parts)


def field_docs(cls: type) -> dict[str, Any]:
    """Each field's one-line documentation (``doc(...)`` metadata), nested as :func:`field_defaults`."""
    out: dict[str, Any] = {}
    for f in attrs.fields(attrs.resolve_types(cls)):
        if f.metadata.get("internal"):
            continue
        nested = f.type if isinstance(f.type, type) and attrs.has(f.type) else None
        out[f.name] = field_docs(nested) if nested is not None else f.metadata.get("doc", "")
    return out


def _described(tree: dict[str, Any], docs: dict[str, Any], indent: str = "") -> list[str]:
    """YAML lines of ``tree`` with each leaf's description as a trailing comment."""
    import yaml

    lines = []
    for key, value in tree.items():
        doc_ = docs.get(key) if isinstance(docs, dict) else None
        if isinstance(value, dict) and value and isinstance(doc_, dict):
            lines.append(f"{indent}{key}:")
            lines += _described(value, doc_, indent + "  ")
            continue
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=10**6).strip()[1:-1]
        lines.append(f"{indent}{text}" + (f"  # {doc_}" if isinstance(doc_, str) and doc_ else ""))
    return lines


def format_described(defaults: dict[str, Any], manager: Any) -> str:
    """:func:`format_defaults` with each key's description as a YAML comment (``rlcore config --defaults``)."""
    from rlcore.config.structure import set_dotted

    parts = ["# rlcore run: the defaults of every key a recipe leaves out, each with what it does",
             *_described(defaults["core"], field_docs(RunConfig))]
    docs = {(reg.section, reg.name): field_docs(reg.config_cls) for reg in manager.iter_registrations()
            if reg.section is not None and reg.config_cls is not None and attrs.has(reg.config_cls)}
    for section in defaults["sections"]:
        tree: dict[str, Any] = {}
        doc_tree: dict[str, Any] = {}
        set_dotted(tree, section["path"], section["defaults"])
        set_dotted(doc_tree, section["path"], docs.get((section["path"], section["name"]), {}))
        parts += ["", f"# {section['path']}: {section['kind']} '{section['name']}' ({section['distribution']})",
                  *_described(tree, doc_tree)]
    return "\n".join(parts) + "\n"
