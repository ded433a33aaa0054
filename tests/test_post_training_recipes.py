"""The tiny CPU recipes of the other post-training families, each run as written (from the
repository root, through ``rlcore run``) for two steps on a random-init tiny Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _run_recipe(recipe: str, *overrides: str) -> subprocess.CompletedProcess:
    rlcore = Path(sys.executable).with_name("rlcore")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    result = subprocess.run([str(rlcore), "run", recipe, *overrides], cwd=ROOT, env=dict(env, PYTHONWARNINGS="ignore"),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_dpo_recipe_raises_held_out_margin(tiny_model_dir, tmp_path, backend):
    """recipes/dpo_tiny_cpu.yaml, two steps: held-out margin 0 (policy = reference) -> positive."""
    switch = (["policy.megatron_cfg.enabled=true", "policy.dtensor_cfg.enabled=false"] if backend == "megatron" else [])
    result = _run_recipe("recipes/dpo_tiny_cpu.yaml", f"policy.model_name={tiny_model_dir}",
                         f"logger.log_dir={tmp_path / 'run'}", "grpo.max_num_steps=2", "grpo.val_period=2", *switch)
    assert f"training backend: {backend}" in result.stdout
    records = _records(tmp_path / "run")
    assert records[0]["val/reward_margin"] == 0.0 and records[0]["val/accuracy"] == 0.0
    assert records[2]["val/reward_margin"] > 0.05 and records[2]["val/accuracy"] > 0.9, records[2]
    assert records[1]["train/preference_loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy = reference
    assert records[2]["train/preference_loss"] < records[1]["train/preference_loss"]
    assert (tmp_path / "run" / "model" / "config.json").is_file()
