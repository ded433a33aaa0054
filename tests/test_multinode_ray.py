"""Trainer ranks on two Ray nodes give the same GRPO steps as on one node.

A real Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``: two raylets, each
with its own CPUs and object store, joined to one GCS). One driver process (``rlcore.run``
joining the cluster through ``cluster.ray_address``; the ``hf`` generator in it, on the head
node) runs the same deterministic 2-step recipe twice: 2 FSDP2 ranks placed ``SPREAD`` (one rank
per node; the gloo process group meets at the address rank 0's node reports, weights cross nodes
in the refit), then ``STRICT_PACK`` (both ranks on one node). Every metric but timings must be
equal. A third run asks for more ranks than the cluster has CPUs and must fail before any actor
starts, naming what is missing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

CPUS_PER_NODE = 2
TIMING_PREFIXES = ("timing/", "refit/seconds", "refit/gb_per_s", "train/seconds", "run_id")


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_NODE, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=CPUS_PER_NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _recipe(model_dir: Path, run_dir: Path, address: str) -> dict:
    return {
        "policy": {
            "model_name": str(model_dir), "precision": "float32", "max_total_sequence_length": 48,
            # weight decay moves every weight each step, so a refit that did not arrive fails the probe
            "optimizer": {"lr": 1e-3, "weight_decay": 1.0}, "dtensor_cfg": {"enabled": True},
            "generation": {"backend": "hf", "max_new_tokens": 3, "temperature": 1.0},
        },
        # A random model earns no reward; the KL term to the reference gives step 2 a loss and a gradient.
        "algorithm": {"name": "grpo", "kl_coef": 0.5},
        "data": {"name": "arithmetic", "digits": 1, "num_validation": 8, "num_train": 64},
        "env": {"name": "math", "math": {"executor": "inline"}},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": 2, "val_period": 0,
                 "seed": 3, "deterministic": True},
        "cluster": {"use_ray": True, "cpu_workers": 2, "ray_address": address, "timeout_s": 120},
        "logger": {"log_dir": str(run_dir), "print_table": False},
        "checkpointing": {"enabled": False},
    }


@pytest.fixture(scope="module")
def runs(two_node_cluster, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tiny_model_dir, tmp / "unused", two_node_cluster.address)))
    code = textwrap.dedent(f"""
        import rlcore
        from rlcore.controller.ray_placement import PlacementError
        if __name__ == "__main__":
            for strategy in ("SPREAD", "STRICT_PACK"):
                rlcore.run(rlcore.load_config({str(path)!r}, overrides=[
                    f"cluster.placement_strategy={{strategy}}", f"logger.log_dir={tmp}/{{strategy}}"]))
            try:
                rlcore.run(rlcore.load_config({str(path)!r}, overrides=["cluster.cpu_workers=5",
                                                                      "cluster.placement_strategy=SPREAD"]))
            except PlacementError as exc:
                print("placement refused:", exc, flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)
    return done, tmp


def _records(run_dir: Path) -> dict[int, dict]:
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES)}
    return records


def test_ranks_on_two_nodes_match_one_node(runs):
    done, tmp = runs
    assert done.returncode == 0, done.stderr[-3000:]
    placed = re.findall(r"trainer: 2 ranks on (\d) node\(s\) \((\w+)\): rank 0 on (\S+) \(node (\w+)\), "
                        r"rank 1 on (\S+) \(node (\w+)\); process group at (\S+):(\d+)", done.stdout)
    assert [(n, strategy) for n, strategy, *_ in placed] == [("2", "SPREAD"), ("1", "STRICT_PACK")], done.stdout[-3000:]
    spread = placed[0]
    assert spread[3] != spread[5]  # two nodes
    assert spread[6] == spread[2] and not spread[6].startswith("127."), spread  # rank 0's node's own address
    a, b = _records(tmp / "SPREAD"), _records(tmp / "STRICT_PACK")
    assert sorted(a) == sorted(b) == [1, 2]
    assert a[2]["train/kl"] > 0 and a[2]["train/grad_norm"] > 0, a[2]  # the numbers compared are not all zero
    for step in (1, 2):
        assert a[step]["refit/bytes"] > 0 and a[step]["refit/probe_max_abs_logprob_diff"] < 1e-4, a[step]
        assert a[step].keys() == b[step].keys()
        for key in a[step]:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_a_placement_the_cluster_cannot_hold_fails_at_once_naming_what_is_missing(runs):
    done, _ = runs
    refused = [line for line in done.stdout.splitlines() if line.startswith("placement refused:")]
    assert len(refused) == 1, done.stdout[-3000:]
    assert "5 trainer ranks need 5 bundles of {CPU 1} (SPREAD)" in refused[0], refused[0]
    assert "2 alive node(s)" in refused[0] and "too few: 1 CPU missing" in refused[0], refused[0]
