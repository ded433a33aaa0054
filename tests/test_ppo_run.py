"""PPO through ``rlcore.run`` on CPU (fsdp2 backend, hf generator): the critic is built on the
trainer's ranks, warms up, trains beside the policy, is offloaded between its phases, is checkpointed
and resumed with it, and is exported at the end; the step records carry its phases."""

from __future__ import annotations

import json

import pytest

from test_loop import assert_same_record, load_records, preloaded_runs, run_recipe, tiny_recipe  # noqa: F401 - preloaded_runs: autouse here too

pytestmark = pytest.mark.slow

PPO = {"algorithm.name": "ppo", "algorithm.critic_warmup_steps": 1, "algorithm.critic.lr": 1e-3,
       "algorithm.gae_lambda": 0.95, "train.val_period": 0,
       # every response earns 0.5 (a random tiny model answers nothing right): returns the zero-initialized critic must learn
       "env.math.answer_format": "none", "env.math.format_reward": 0.5}


def test_ppo_runs_resumes_and_exports_its_critic(tiny_model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight = run_recipe(tiny_recipe(tiny_model_dir, straight_dir, **PPO, **{"train.max_num_steps": 3}), tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    lines = [json.loads(line) for line in (straight_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert lines[0]["critic/warmup"] == 1.0 and "train/loss" not in lines[0]  # step 1 trains the critic alone
    for record in lines:
        assert record["timing/values"] > 0 and record["timing/critic_train"] > 0
        assert record["critic/value_loss"] > 0 and record["critic/num_optimizer_steps"] == 1.0
    assert all("train/loss" in r and "critic/warmup" not in r for r in lines[1:])
    assert (straight_dir / "ckpt" / "step_000003" / "critic").is_dir()
    critic = AutoModelForTokenClassification.from_pretrained(straight_dir / "critic")  # the exported value model
    assert critic.config.num_labels == 1 and float(critic.score.weight.abs().max()) > 0  # the zero head trained
    summary = json.loads((straight_dir / "summary.json").read_text())
    assert summary["timing/values"] > 0 and summary["timing/critic_train"] > 0

    # The interrupted run also offloads the policy's and the critic's state between their phases (on CPU
    # the fsdp2 backend copies each storage out and frees it); checkpoints bring the critic back to save it.
    offload = {"policy.generation.colocated.offload_trainer_state": True}
    first = run_recipe(tiny_recipe(tiny_model_dir, resumed_dir, **PPO, **offload, **{"train.max_num_steps": 2}), tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_recipe(tiny_recipe(tiny_model_dir, resumed_dir, **PPO, **offload, **{"train.max_num_steps": 3}), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    a, b = load_records(straight_dir), load_records(resumed_dir)
    # the critic's state came back too, offloading changed nothing: values, losses and steps equal
    assert_same_record(a[3], b[3], "step 3")
