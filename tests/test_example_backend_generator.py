"""The example third-party training backend (examples/ddp_backend_plugin, ``rlcore-ddp``) and
generator (examples/hf_static_generator_plugin, ``rlcore-hf-static``) are found once installed,
pass their own conformance suites against the installed copies, and run GRPO together.

Installed as tests/test_example_plugin.py installs the toy environment: real wheel builds into a
temporary ``--target`` directory that the subprocesses get on ``PYTHONPATH``, leaving the shared
environment unchanged.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_example_plugin import _env  # a child process environment without rlcore variables, the given site on the path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"rlcore-ddp": REPO / "examples" / "ddp_backend_plugin",
            "rlcore-hf-static": REPO / "examples" / "hf_static_generator_plugin"}
BIN = Path(sys.executable).parent


def _run(args: list[str], site: Path | None, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=_env(site), cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """(site directory holding both installed examples, a copy of each example's source tree)."""
    root = tmp_path_factory.mktemp("example-plugins")
    sources = {}
    for dist, example in EXAMPLES.items():  # copies: setuptools writes build/ and egg-info beside the sources
        sources[dist] = root / example.name
        shutil.copytree(example, sources[dist], ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    result = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                   "--disable-pip-version-check", "--quiet", "--target", str(site), *map(str, sources.values())], None)
    assert result.returncode == 0, result.stdout + result.stderr
    return site, sources


def test_installed_examples_are_listed(installed):
    site, _ = installed
    result = _run([str(BIN / "rlcore"), "plugins", "--json"], site)
    assert result.returncode == 0, result.stderr
    listed = {d["distribution"]: d for d in json.loads(result.stdout)}
    (backend,) = listed["rlcore-ddp"]["provides"]["training_backend"]
    assert listed["rlcore-ddp"]["entry_points"] == ["ddp = rlcore_ddp.plugin"]
    assert backend["name"] == "ddp" and backend["section"] == "policy.ddp_cfg" and backend["config"] == "rlcore_ddp.config.DDPConfig"
    assert backend["capabilities"]["precedence"] == 5 and backend["capabilities"]["parallelism"] == ["dp"]
    (generator,) = listed["rlcore-hf-static"]["provides"]["generator"]
    assert generator["name"] == "hf_static" and generator["section"] == "policy.generation"
    assert generator["config"] == "rlcore_hf_static.config.HFStaticGenerationConfig"


def test_shared_environment_is_unchanged(installed):
    result = _run([str(BIN / "rlcore"), "plugins", "--json"], None)
    assert not {"rlcore-ddp", "rlcore-hf-static"} & {d["distribution"] for d in json.loads(result.stdout)}


@pytest.mark.parametrize("dist, min_passed", [("rlcore-ddp", 7), ("rlcore-hf-static", 8)])
def test_example_passes_its_conformance_suite(installed, dist, min_passed):
    site, sources = installed
    source = sources[dist]
    result = _run([sys.executable, "-m", "pytest", str(source / "tests"), "-q", "-p", "no:cacheprovider",
                   "-W", "ignore::pytest.PytestRemovedIn10Warning", "--rootdir", str(source)], site, cwd=source)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary and "skipped" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= min_passed, summary
    module = dist.replace("-", "_")
    where = _run([sys.executable, "-c", f"import {module}; print({module}.__file__)"], site)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # the installed copy ran


def test_grpo_steps_with_both_examples(installed, tiny_model_dir, tmp_path):
    """``rlcore run`` with the ddp backend and the hf_static generator: both are what the run
    built, every refit went through the generator plugin's transport, and the refit probe (the
    generator's logprobs against the trainer's) agrees to fp32 rounding."""
    site, _ = installed
    log_dir = tmp_path / "run"
    result = _run([str(BIN / "rlcore"), "run", str(REPO / "recipes" / "grpo_arith_tiny_cpu.yaml"),
                   f"policy.model_name={tiny_model_dir}", "policy.ddp_cfg.enabled=true", "policy.generation.backend=hf_static",
                   "train.max_num_steps=2", "train.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
                   "train.val_at_start=false", "train.val_period=0", f"logger.log_dir={log_dir}"], site, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "training backend: ddp (policy.ddp_cfg); also enabled but of lower precedence: fsdp2" in result.stdout
    assert "refit transport: hf_static-in-place" in result.stdout
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r or "timing/total" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["refit/bytes"] > 0 and record["refit/probe_max_abs_logprob_diff"] < 1e-4, record
