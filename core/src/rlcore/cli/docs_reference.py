"""The configuration reference page, generated from the attrs schemas of the core and of every
installed plugin (key, type, default, doc).

    python -m rlcore.cli.docs_reference                 # writes docs/reference/configuration.md
    python -m rlcore.cli.docs_reference --check         # exits 1 when the committed page has drifted

The page is read from the same registrations ``rlcore config --defaults`` prints, so every key a
run accepts is on it. Hand-written because mkdocstrings documents Python objects, not a tree of
recipe keys with their YAML defaults. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import attrs

from rlcore.cli.parser import Parser
from rlcore.loading.defaults import REQUIRED
from rlcore.config.schema import RunConfig

DEFAULT_OUT = Path("docs/reference/configuration.md")
HEADER = """# Configuration reference

Every key of a recipe, with its type, default and meaning, generated from the schemas of
`rlcore` and of the plugins installed where the page was built
(`python -m rlcore.cli.docs_reference`; `make docs` regenerates it). A section several plugins share
(`policy.generation`, `algorithm`, `data`, `env`) has one table per provider, chosen in a recipe
by its `backend` or `name` key. Keys under an `experimental` section exist to measure an
alternative against the default; they may change or go without notice.
`rlcore config --defaults` prints the same defaults as YAML.
On the command line, `dotted.key=value` sets a key over the recipe and `~dotted.key` removes one the
recipe sets: switching a shared section's provider drops the old provider's own keys, e.g.
`policy.generation.backend=sglang '~policy.generation.max_num_seqs'`.
"""


def type_name(tp: Any) -> str:
    """A short, readable name of a field's type annotation."""
    if tp is None or tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = typing.get_args(tp)
        base = getattr(origin, "__name__", str(origin))
        return f"{base}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]" if args else base
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _default(f: attrs.Attribute) -> Any:
    from rlcore.config.structure import unstructure

    default = f.default
    if default is attrs.NOTHING:
        return REQUIRED
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory(None) if default.takes_self else default.factory()
    return unstructure(default)


def rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    """``(key, type, default, doc)`` for each field of ``cls``; nested schemas expanded in place."""
    out = []
    for f in attrs.fields(attrs.resolve_types(cls)):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        if isinstance(f.type, type) and attrs.has(f.type):
            out.append((key, "section", "", f.metadata.get("doc", "") or (f.type.__doc__ or "").strip()))
            out.extend(rows(f.type, key))
            continue
        default = _default(f)
        shown = default if default == REQUIRED else json.dumps(default, default=str)
        out.append((key, type_name(f.type), shown, f.metadata.get("doc", "")))
    return out


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def table(entries: list[tuple[str, str, str, str]]) -> str:
    lines = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for key, tp, default, text in entries:
        lines.append(f"| `{key}` | {_code(tp)} | {_code(default)} | {_cell(text)} |")
    return "\n".join(lines)


def sections(manager: Any) -> list[dict[str, Any]]:
    """Each plugin section (path, kind, name, distribution, schema), in a stable order."""
    found = []
    for reg in manager.iter_registrations():
        if reg.section is None or reg.config_cls is None or not attrs.has(reg.config_cls):
            continue
        found.append({"path": reg.section, "kind": reg.kind, "name": reg.name,
                      "distribution": reg.source.distribution, "cls": reg.config_cls})
    return sorted(found, key=lambda s: (s["path"], s["distribution"] != "rlcore", s["name"]))


def render(manager: Any) -> str:
    parts = [HEADER, "## Core keys (`rlcore`)\n"]
    core = rows(RunConfig, "")
    tops = [f for f in attrs.fields(attrs.resolve_types(RunConfig)) if not f.metadata.get("internal")]
    for f in tops:
        entries = [r for r in core if r[0] == f.name and r[1] != "section" or r[0].startswith(f.name + ".")]
        parts.append(f"### `{f.name}`\n")
        if isinstance(f.type, type) and attrs.has(f.type) and f.type.__doc__:
            parts.append(_cell(f.type.__doc__) + "\n")
        parts.append(table(entries) + "\n")
    parts.append("## Plugin sections\n")
    for s in sections(manager):
        parts.append(f"### `{s['path']}`: {s['kind']} `{s['name']}` ({s['distribution']})\n")
        if s["cls"].__doc__:
            parts.append(_cell(s["cls"].__doc__) + "\n")
        parts.append(table(rows(s["cls"], s["path"])) + "\n")
    return "\n".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m rlcore.cli.docs_reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the page (default {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="compare with the page instead of writing it")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rlcore.plugins import get_plugin_manager

    text = render(get_plugin_manager())
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} differs from the schemas; regenerate it with `python -m rlcore.cli.docs_reference` "
                  "(or `make docs`)", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
