"""A GRPO run whose rollouts are an agent's, through the endpoint (fsdp2 backend, hf generator, tiny
Llama): 5% of agent attempts fail and are retried, the groups of problems whose answer ends in 7
always fail and are dropped; the step's advantages cover exactly the surviving groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlcore
from rlcore.algorithms.config import GRPOConfig
from rlcore.algorithms.grpo import GRPO

pytestmark = pytest.mark.slow
pytest.importorskip("fastapi")

AGENT = Path(__file__).with_name("_flaky_agent.py")


class RecordingGRPO(GRPO):
    """GRPO that keeps what each step's advantages were computed on."""

    def __init__(self):
        super().__init__(GRPOConfig())
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def advantages(self, rewards_N, group_ids_N):
        self.seen.append((rewards_N.clone(), group_ids_N.clone()))
        return super().advantages(rewards_N, group_ids_N)


def test_agent_failures_are_retried_dropped_counted_and_kept_out_of_advantages(tiny_model_dir, tmp_path):
    import sys

    sys.path.insert(0, str(AGENT.parent))
    import _flaky_agent

    config = rlcore.build_config({
        "policy": {"model_name": str(tiny_model_dir), "precision": "float32", "max_total_sequence_length": 48,
                   "optimizer": {"lr": 1e-3, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True},
                   "generation": {"backend": "hf", "max_new_tokens": 3, "temperature": 1.0}},
        "algorithm": {"name": "grpo"},
        "data": {"name": "arithmetic", "digits": 1, "num_validation": 8, "num_train": 64},
        "env": {"name": "agent", "agent": {"function": "_flaky_agent:agent", "max_turns": 1, "max_retries": 2}},
        "train": {"num_prompts_per_step": 8, "max_num_steps": 2, "val_period": 0, "val_at_start": False, "seed": 3},
        "grpo": {"num_generations_per_prompt": 4},
        "logger": {"log_dir": str(tmp_path / "run"), "print_table": False, "plot": False},
    })
    algorithm = RecordingGRPO()
    out = rlcore.run(config, algorithm=algorithm)
    records = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/infra_failures" in r]
    assert len(steps) == 2 and len(algorithm.seen) == 2
    assert sum(r["rollout/infra_failures"] for r in steps) == len(_flaky_agent.FAILED)
    assert all(r.get("rollout/infra_failures/agent_error", 0.0) == r["rollout/infra_failures"] for r in steps)
    dropped = sum(r["rollout/dropped_groups"] for r in steps)
    assert dropped >= 1  # answers ending in 7 are common among 1-digit sums
    for record, (rewards_N, groups_N) in zip(steps, algorithm.seen):
        surviving = 8 - record["rollout/dropped_groups"]
        assert len(groups_N.unique()) == surviving and len(rewards_N) == 4 * surviving == record["rollout/num_trajectories"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_hung_agent_ends_rlcore_run_with_one_line_naming_its_trajectory(tiny_model_dir, tmp_path, capfd, mode):
    import yaml

    from rlcore.cli.commands import main

    recipe = {
        "policy": {"model_name": str(tiny_model_dir), "precision": "float32", "max_total_sequence_length": 48,
                   "dtensor_cfg": {"enabled": True}, "generation": {"backend": "hf", "max_new_tokens": 2}},
        "algorithm": {"name": "grpo"},
        "data": {"name": "arithmetic", "digits": 1, "num_validation": 4, "num_train": 8},
        "env": {"name": "agent", "agent": {"function": f"{AGENT.with_name('_hung_agent.py')}:agent"}},
        "train": {"num_prompts_per_step": 4, "max_num_steps": 1, "val_period": 0, "val_at_start": False, "seed": 3},
        "grpo": {"num_generations_per_prompt": 2, "async_grpo": {"enabled": mode == "async"}},
        "cluster": {"timeout_s": 20},
        "logger": {"log_dir": str(tmp_path / "run"), "print_table": False, "plot": False},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    capfd.readouterr()
    assert main(["run", str(tmp_path / "recipe.yaml")]) == 1
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 1
    assert "did not finish" in errors[0] and "(sample 2, trajectory 0, attempt 0; 1 requests served)" in errors[0]
