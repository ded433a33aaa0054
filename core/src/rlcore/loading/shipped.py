"""The recipes that ship inside the ``rlcore`` package, found by name.

The checkout's ``recipes/`` is their one source: ``src/rlcore/recipes`` is a symlink to it, so an
editable install reads the checkout's files and a built wheel carries copies of them (package
data). ``rlcore recipes`` lists them and copies one out; ``rlcore run NAME`` (and ``rlcore config``,
``rlcore.load_config``) takes a shipped recipe's name, or a ``recipes/NAME.yaml`` path that does
not exist where it runs (the documentation's commands, typed outside a checkout). The data files the
shipped recipes name (``recipes/data/NAME``) are found the same way.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """Name (the file's stem) -> path of every shipped recipe, sorted by name."""
    if not SHIPPED.is_dir():
        return {}
    return {p.stem: p for p in sorted(SHIPPED.glob("*.yaml"))}


def shipped_recipe(path: str | Path) -> Path | None:
    """The shipped recipe that ``path`` names: ``NAME``, ``NAME.yaml`` or ``recipes/NAME.yaml``
    (a path with other directories names a file of the user's, never a shipped one)."""
    path = Path(path)
    if len(path.parts) > 2 or (len(path.parts) == 2 and path.parts[0] != "recipes"):
        return None
    if path.suffix not in ("", ".yaml"):
        return None
    return shipped_recipes().get(path.stem if path.suffix else path.name)


def shipped_data_file(path: str | Path) -> Path | None:
    """The shipped data file that ``recipes/data/NAME`` names, when no such file exists where the run is (a
    shipped recipe run outside a checkout); None for any other path."""
    path = Path(path)
    if path.is_file() or len(path.parts) != 3 or path.parts[:2] != ("recipes", "data"):
        return None
    shipped = SHIPPED / "data" / path.name
    return shipped if shipped.is_file() else None


def summary(path: Path) -> str:
    """A recipe's first header line (what it trains, on what), without the comment sign."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""
