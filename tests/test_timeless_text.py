"""The shipped source and the documentation speak of the project alone: no ordinal labels of past
runs ("fourteenth session"), no pointers to files that do not ship (RESULTS.md, DESIGN.md), no
"seen on an H200" anecdotes. Comments say why, not when or in which run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["core/src", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("plugins/*/src")), "docs", "benchmarks",
         "examples", "recipes"]
FILES = ["README.md", "Makefile", ".ci/run"]
SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".txt", ".sh"}

ORDINALS = ("fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|"
            "sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-[a-z]+|thirtieth|thirty-[a-z]+")
PATTERNS = {
    # "a fifth of the time" is a fraction, not a run's name
    "ordinal run label": re.compile(rf"(?<!\ba )(?<!\bone )\b({ORDINALS})\b|\b(first|second|third) session\b", re.I),
    "pointer to a file that does not ship": re.compile(r"\b(RESULTS|DESIGN)\.md\b"),
    # a measurement that names its machine in a table or a headline ("on one H200, a step takes") is
    # fine; "seen on an H200" as the reason for a line of code is not
    "anecdote": re.compile(r"\bseen (on|at|with|in)\b|\b(on|in) (an|the) H[12]00s?\b|nvidia-h200", re.I),
}

def _files() -> list[Path]:
    found = [ROOT / f for f in FILES]
    for tree in TREES:
        found += [p for p in sorted((ROOT / tree).rglob("*")) if p.is_file() and p.suffix in SUFFIXES]
    return found


def findings(path: Path) -> list[str]:
    out = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for what, pattern in PATTERNS.items():
            if pattern.search(line):
                out.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()[:120]}")
    return out


def test_patterns_catch_what_they_are_for():
    hits = ["see RESULTS.md", "the twenty-eighth session", "Fourteenth run", "seen on an H200", "measured on an H200",
            "on the H200s", "machine nvidia-h200"]
    misses = ["a fifth of the host time", "about one tenth", "first step", "runs on GPUs", "1x NVIDIA H200",
              "On one H200, a GRPO step takes"]
    assert all(any(p.search(text) for p in PATTERNS.values()) for text in hits)
    assert not any(p.search(text) for p in PATTERNS.values() for text in misses)


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_labels_pointers_or_anecdotes(path):
    found = findings(path)
    assert not found, "\n".join(found)
