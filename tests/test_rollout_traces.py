"""Rollout traces of real runs (fsdp2 backend, hf generator, tiny Llama) hold exactly what was
trained: each traced row's ids, loss mask, sampling and trainer logprobs and advantages equal the
training batch's, for the sync and the async loop and for an agent's trajectories (earlier
segments of a rewritten history, failed attempts with their cause, each request's messages)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import rlcore

pytestmark = pytest.mark.slow


def _config(model_dir, run_dir, **extra):
    base = {
        "policy": {"model_name": str(model_dir), "precision": "float32", "max_total_sequence_length": 64,
                   "optimizer": {"lr": 1e-3, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True},
                   "generation": {"backend": "hf", "max_new_tokens": 4, "temperature": 1.0}},
        "algorithm": {"name": "grpo", "use_old_logprobs": True},
        "data": {"name": "arithmetic", "digits": 1, "num_validation": 4, "num_train": 64},
        "env": {"name": "math"},
        "train": {"num_prompts_per_step": 4, "max_num_steps": 2, "val_period": 0, "val_at_start": False, "seed": 5},
        "grpo": {"num_generations_per_prompt": 4},
        "logger": {"log_dir": str(run_dir), "print_table": False, "plot": False, "rollouts": {"per_step": 64}},
    }
    for key, value in extra.items():
        base[key] = {**base.get(key, {}), **value}
    return rlcore.build_config(base)


def _run_keeping_batches(config) -> list:
    """The run (as rlcore.run runs it), and each step's training batch."""
    from rlcore.controller.grpo_run import build_components
    from rlcore.controller.async_driver import run_async
    from rlcore.controller.loop import GRPOLoop, run_sync

    c = build_components(config)
    loop = GRPOLoop(c)
    batches = []
    train_on = loop.learner.train_on

    def keeping(trajectories, timer, step):
        metrics, batch = train_on(trajectories, timer, step)
        batches.append(batch)
        return metrics, batch

    loop.learner.train_on = keeping
    try:
        loop.run(run_async if config.grpo.async_grpo.enabled else run_sync)
    finally:
        c.traces.close()
        c.trainer.shutdown()
        c.generator.shutdown()
    return batches


def _traces(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def _assert_rows_equal_batch(traces: list[dict], batches: list, versions=(0, 1)) -> int:
    """Every trajectory and segment trace equals its batch row, sampled with weights ``versions[step - 1]``;
    returns how many were checked."""
    checked = 0
    for trace in traces:
        if trace["kind"] not in ("trajectory", "segment"):
            continue
        batch, row = batches[trace["step"] - 1], trace["row"]
        start = len(trace["prompt_ids"])
        assert torch.equal(torch.tensor(trace["prompt_ids"] + trace["response_ids"]), batch.input_ids[row])
        assert torch.equal(torch.tensor(trace["loss_mask"], dtype=torch.float32), batch.loss_mask[row][start:])
        assert not batch.loss_mask[row][:start].any()
        for name, field in (("sampling_logprobs", "gen_logprobs"), ("trainer_logprobs", "old_logprobs")):
            # shortest decimals of float32 values read back to the very same float32 values
            assert torch.equal(torch.tensor(trace[name], dtype=torch.float32), batch.token_fields[field][row][start:])
        assert torch.equal(torch.tensor(trace["advantage"], dtype=torch.float32), batch.seq_fields["advantages"][row])
        assert torch.equal(torch.full_like(batch.token_fields["advantages"][row], trace["advantage"]),
                           batch.token_fields["advantages"][row])
        assert trace["reward"] == pytest.approx(float(batch.seq_fields["rewards"][row]))
        assert sum(trace["loss_mask"]) > 0 and trace["policy_version"] == versions[trace["step"] - 1]
        checked += 1
    return checked


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_traces_hold_what_was_trained(tiny_model_dir, tmp_path, mode):
    extra = {"grpo": {"async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}}} if mode == "async" else {}
    run_dir = tmp_path / "run"
    batches = _run_keeping_batches(_config(tiny_model_dir, run_dir, **extra))
    traces = _traces(run_dir)
    assert [t["step"] for t in traces] == [1] * 16 + [2] * 16  # per_step 64: every trajectory of each step
    # one step off: step 2's rollouts were sampled beside step 1's training, with the first weights
    assert _assert_rows_equal_batch(traces, batches, (0, 0) if mode == "async" else (0, 1)) == 32
    assert all(t["prompt"] and isinstance(t["completion"], str) for t in traces)
    rewards = [t["reward"] for t in traces if t["step"] == 1]
    assert rewards == sorted(rewards)  # spread from the worst to the best


def test_agent_traces_hold_segments_failures_and_turns(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    sys.modules.pop("_trace_agent", None)
    run_dir = tmp_path / "run"
    config = _config(tiny_model_dir, run_dir, env={"name": "agent", "agent": {"function": "_trace_agent:agent", "max_turns": 2}},
                     policy={"max_total_sequence_length": 96})
    batches = _run_keeping_batches(config)
    traces = _traces(run_dir)
    segments = [t for t in traces if t["kind"] == "segment"]
    failures = [t for t in traces if t["kind"] == "failure"]
    assert segments and all(t["sample"] % 2 == 1 for t in segments)  # odd samples rewrote their history
    assert _assert_rows_equal_batch(traces, batches) == 32 + len(segments)
    assert failures and all(f["cause"] == "agent_error" and "sandbox crashed" in f["error"] and f["sample"] % 3 == 0
                            for f in failures)
    extended = [t for t in traces if t["kind"] == "trajectory" and t["sample"] % 2 == 0]
    assert extended and all([m["content"] for m in t["turns"][1]["messages"]] == ["Sure?"] for t in extended)
    assert all(t["env_metrics"]["agent_requests"] == 2.0 for t in traces if t["kind"] == "trajectory")
