"""The heavy-tailed multi-turn workload of ``benchmarks/bench_multiturn_env.py``: seeded per
(sample, trajectory, turn), so every variant of a comparison meets the same work, and its
distributions are the ones the benchmark names (lognormal turn lengths clipped to 32..2048 tokens,
tool latencies with median 0.5 s and p99 8 s, 3 to 5 turns)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_multiturn_env import BenchToolConfig, HeavyTailedToolEnv, HeavyTailedWorkload, build  # noqa: E402

from rlcore.interfaces import Sample, TrajectoryTurns  # noqa: E402

N = 4000  # draws; the quantile tolerances below are several standard errors at this size


def _config(**kw):
    return BenchToolConfig(**{"workload": "heavy_tailed", "min_turns": 3, "max_turns": 5, "turn_stop_strings": (), **kw})


def _quantile(values, q):
    values = sorted(values)
    return values[int(q * (len(values) - 1))]


def test_draws_depend_on_their_key_and_seed_alone():
    a, b, other = HeavyTailedWorkload(_config()), HeavyTailedWorkload(_config()), HeavyTailedWorkload(_config(seed=1))
    keys = [(s, k, t) for s in range(5) for k in range(4) for t in range(5)]
    forward = [a.turn_tokens(*key) for key in keys] + [a.latency_s(*key) for key in keys]
    backward = [b.turn_tokens(*key) for key in reversed(keys)][::-1] + [b.latency_s(*key) for key in reversed(keys)][::-1]
    assert forward == backward  # call order does not matter (a turn barrier changes it)
    assert forward != [other.turn_tokens(*key) for key in keys] + [other.latency_s(*key) for key in keys]
    assert [a.turns(s, k) for s in range(5) for k in range(4)] == [b.turns(s, k) for s in range(5) for k in range(4)]


def test_distributions_are_the_named_ones():
    w = HeavyTailedWorkload(_config())
    tokens = [w.turn_tokens(i, 0, 0) for i in range(N)]
    latencies = [w.latency_s(i, 0, 0) for i in range(N)]
    turns = [w.turns(i, 0) for i in range(N)]
    assert min(tokens) == 32 and max(tokens) == 2048  # both clips are reached
    assert statistics.median(tokens) == pytest.approx(192, rel=0.08)
    assert statistics.median(latencies) == pytest.approx(0.5, rel=0.08)
    assert _quantile(latencies, 0.99) == pytest.approx(8.0, rel=0.3)  # ~40 draws above it: a wide standard error
    assert set(turns) == {3, 4, 5} and all(abs(turns.count(k) / N - 1 / 3) < 0.04 for k in (3, 4, 5))


def test_the_environment_ends_each_trajectory_at_its_drawn_turn_count():
    env = build(_config(latency_median_s=1e-4, latency_p99_s=1e-3))
    assert isinstance(env, HeavyTailedToolEnv) and isinstance(env, TrajectoryTurns)
    sample = Sample(prompt="q", index=7)
    for k in range(3):
        want = env.draws.turns(7, k)
        history, steps = [], []
        while not steps or not steps[-1].done:
            history.append(f"turn {len(history)}")
            steps.append(env.step_trajectory(sample, k, list(history)))
        assert len(steps) == want and all(s.observation for s in steps[:-1])
        assert env.turn_max_new_tokens(sample, k, 1) == env.draws.turn_tokens(7, k, 1)


def test_bad_workload_settings_name_the_key():
    with pytest.raises(ValueError, match="min_turns"):
        HeavyTailedWorkload(_config(min_turns=6))
    with pytest.raises(ValueError, match="turn_tokens_range"):
        HeavyTailedWorkload(_config(turn_tokens_range=(64, 32)))


def test_multi_turn_rows_get_both_bounds_from_the_single_turn_row_of_the_call():
    import bench_grpo_step

    single = {"config": "llama1b-megatron", "samples": 256, "max_new_tokens": 1024, "tokens_per_sample": 1024.0,
              "generation_s": 10.0}  # 26,214 tokens/s; a decode step of 1024 steps in 10 s
    turns = {"config": "llama1b-multiturn-async", "generation_s": 40.0, "rollout/generated_tokens": 262_144.0,
             "rollout/longest_trajectory_model_tokens": 2048.0, "rollout/longest_trajectory_env_s": 12.0}
    bench_grpo_step.add_bounds([single, turns])
    assert turns["token_bound_s"] == pytest.approx(10.0)
    assert turns["critical_path_bound_s"] == pytest.approx(2048 * 10.0 / 1024 + 12.0)
    assert turns["generation_over_bound"] == pytest.approx(40.0 / 32.0) and "token_bound_s" not in single
