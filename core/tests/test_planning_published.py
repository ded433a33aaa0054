"""The guide's table of published runs beside the planner's predictions is generated and current, and the
layouts those runs used are accepted as fitting on 80 GB H100s."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.planning import published

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "planning.md"
RECIPES = ROOT / "recipes"


@pytest.fixture(autouse=True)
def no_user_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_CALIBRATION", str(tmp_path / "none.json"))


def test_the_guides_table_is_current():
    text = GUIDE.read_text()
    shown = text[text.index(published.BEGIN) + len(published.BEGIN):text.index(published.END)].strip()
    assert shown == published.table(RECIPES), "regenerate: python -m rlcore.planning.published --write docs/guides/planning.md"


@pytest.mark.parametrize("row", published.ROWS, ids=[f"{r.model} {r.backend}" for r in published.ROWS])
def test_the_published_layouts_fit_80gb_h100s(row):
    est = published.predict(row, RECIPES)
    assert est.fits, est.memory.problem
    assert est.layout.dp(8 * row.nodes) * est.layout.tp * est.layout.pp * est.layout.cp == 8 * row.nodes
    assert all(v >= 0 for v in est.phases.values()) and est.step_s > 0
