"""``rlcore plan`` through the real command-line entry point: every bad input exits 2 with one line naming
its key; the table fits 120 columns unless ``--wide``; no time it prints is negative or infinite."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import numpy as np

from rlcore.cli.commands import main
from rlcore.generation.batching import Trajectory, rollout_metrics
from rlcore.interfaces import GenerationResult, Sample
from rlcore.planning.command import seconds

ROOT = Path(__file__).resolve().parents[2]
DENSE = str(ROOT / "recipes" / "grpo_math_8B_megatron.yaml")  # Megatron TP=2, colocated, 8 GPUs
MOE = str(ROOT / "recipes" / "grpo_qwen3_30BA3B_megatron.yaml")
FSDP2_APART = str(ROOT / "recipes" / "grpo_math_8B_async.yaml")  # FSDP2, generation on 4 GPUs of its own
MCFG = "policy.megatron_cfg."


@pytest.fixture(autouse=True)
def no_user_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_CALIBRATION", str(tmp_path / "none.json"))


def plan(capsys, *argv) -> tuple[int, str, str]:
    status = main(["plan", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


BAD = [
    # (arguments, the key the error names, what the message says)
    ((DENSE, "--gpus", "-4"), "--gpus", "must be a positive GPU count, got -4"),
    ((DENSE, "--gpus", "0"), "--gpus", "got 0"),
    ((DENSE, "--nodes", "0"), "--nodes", "must be a positive node count"),
    ((DENSE, "--gpus", "8", "--nodes", "3"), "--nodes", "--gpus 8 does not split evenly over 3 nodes"),
    ((DENSE, "--gpus", "9"), "--nodes", "9 GPUs do not fill 2 nodes of cluster.gpus_per_node=8"),
    ((DENSE, "--layers", "-5"), "--layers", "must be a positive layer count, got -5"),
    ((DENSE, "--layers", "0"), "--layers", "got 0"),
    ((DENSE, f"{MCFG}tensor_model_parallel_size=16", "--gpus", "8"), f"{MCFG}tensor_model_parallel_size",
     "= 16 does not divide the 8 training GPUs"),
    ((DENSE, f"{MCFG}tensor_model_parallel_size=3", "--gpus", "8"), f"{MCFG}tensor_model_parallel_size",
     "= 3 does not divide the 8 training GPUs"),
    ((DENSE, f"{MCFG}tensor_model_parallel_size=3", "--gpus", "6"), f"{MCFG}tensor_model_parallel_size",
     "3 does not divide the model's 32 attention heads"),
    ((DENSE, f"{MCFG}tensor_model_parallel_size=1", f"{MCFG}sequence_parallel=false", f"{MCFG}pipeline_model_parallel_size=3",
      "--gpus", "6"), f"{MCFG}pipeline_model_parallel_size", "3 stages do not divide the model's 32 layers"),
    ((DENSE, f"{MCFG}tensor_model_parallel_size=1", f"{MCFG}sequence_parallel=false", f"{MCFG}pipeline_model_parallel_size=4",
      "--gpus", "8", "--layers", "30"), f"{MCFG}pipeline_model_parallel_size", "4 stages do not divide the model's 30 layers"),
    ((DENSE, f"{MCFG}expert_model_parallel_size=2", "--gpus", "8"), f"{MCFG}expert_model_parallel_size", "the model is dense"),
    ((DENSE, f"{MCFG}layout=auto", f"{MCFG}tensor_model_parallel_size=16", "--gpus", "8"), f"{MCFG}tensor_model_parallel_size",
     "= 16 does not divide the 8 training GPUs"),  # layout: auto keeps the sizes the section sets: they are checked
    ((MOE, f"{MCFG}expert_model_parallel_size=6", "--gpus", "48", "--nodes", "6"), f"{MCFG}expert_model_parallel_size",
     "6 does not divide the model's 128 experts"),
    ((DENSE, "policy.generation.tensor_parallel_size=3", "--gpus", "8"), "policy.generation.tensor_parallel_size",
     "3 does not divide the 8 generation GPUs"),
    ((DENSE, "policy.generation.tensor_parallel_size=3", "--gpus", "6"), "policy.generation.tensor_parallel_size",
     "3 does not divide the model's 32 attention heads"),
    ((FSDP2_APART, "--gpus", "4"), "policy.generation.colocated.resources", "4 GPUs for generation leave 0 of the 4 for training"),
    ((FSDP2_APART, "policy.dtensor_cfg.tensor_parallel_size=3", "--gpus", "8"), "policy.dtensor_cfg.tensor_parallel_size",
     "tensor_parallel_size (3) = 3 does not divide the 4 training GPUs"),
    ((DENSE, "--gpus", "8", "--prompt-tokens", "-1"), "--prompt-tokens", "must be a positive token count"),
    ((DENSE, "--gpus", "8", "--response-tokens", "0"), "--response-tokens", "must be a positive token count"),
    ((DENSE, "--gpus", "8", "--response-tokens", "5000"), "--response-tokens", "exceed policy.max_total_sequence_length=4096"),
    ((DENSE, "--gpus", "8", "--response-tokens", "800", "--response-max", "500"), "--response-max", "shorter than the mean"),
    ((DENSE, "--gpus", "8", "--top", "0"), "--top", "must be a positive number of layouts"),
    ((DENSE, "--gpus", "8", "--gpu", "h300"), "--gpu", "unknown GPU 'h300'"),
    ((DENSE, "--gpus", "8", "--shape", "nope"), "--shape", "unknown shape 'nope'"),
    ((DENSE, f"{MCFG}fp8_cfg.enabled=true", "--gpus", "8"), f"{MCFG}fp8_cfg.enabled", "FP8 training is not modelled"),
    ((DENSE, "policy.generation.quantization=fp8", "--gpus", "8"), "policy.generation.quantization", "FP8 rollouts are not modelled"),
    ((DENSE, "policy.generation.kv_cache_dtype=fp8", "--gpus", "8"), "policy.generation.kv_cache_dtype", "FP8 KV cache is not modelled"),
]


@pytest.mark.parametrize("argv, key, says", BAD, ids=[" ".join(a[1:]) for a, _, _ in BAD])
def test_a_bad_input_exits_2_with_one_line_naming_its_key(capsys, argv, key, says):
    status, out, err = plan(capsys, *argv)
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert f"config key '{key}'" in lines[0] and says in lines[0], lines[0]


def test_lengths_from_a_runs_metrics(capsys, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "rollout/mean_response_tokens": 700.0 + s, "rollout/max_response_tokens": 3000.0,
             "rollout/mean_prompt_tokens": 120.0} for s in range(1, 5)]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    status, out, _ = plan(capsys, DENSE, "--gpus", "8", "--lengths-from", str(metrics), "--json", "--top", "1")
    assert status == 0
    data = json.loads(out)
    assert data["lengths"] == {"prompt_tokens": 120, "response_tokens": 703, "response_max": 3000}  # steps 2-4: the first is left out
    # bad files: missing, not JSON, without the rollout metrics, and alongside explicit lengths
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "other.jsonl").write_text(json.dumps({"loss": 1.0}) + "\n")
    for argv, says in (((str(tmp_path / "missing.jsonl"),), "is not a file"), ((str(tmp_path / "bad.jsonl"),), "line 1: not JSON"),
                       ((str(tmp_path / "other.jsonl"),), "has no record with rollout/mean_response_tokens"),
                       ((str(metrics), "--response-tokens", "500"), "not both")):
        status, _, err = plan(capsys, DENSE, "--gpus", "8", "--lengths-from", *argv)
        assert status == 2 and "config key '--lengths-from'" in err and says in err, err


def _metrics(path: Path, **percentiles) -> Path:
    rows = [{"step": s, "rollout/mean_response_tokens": 703.0, "rollout/max_response_tokens": 3000.0,
             "rollout/mean_prompt_tokens": 120.0, **{f"rollout/{k}_response_tokens": v for k, v in percentiles.items()}}
            for s in range(1, 5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_lengths_from_a_runs_percentiles_price_attention_by_their_spread(capsys, tmp_path):
    """The run logs its responses' percentiles; the plan reads them: the sequences' mean square length (attention
    FLOPs in training and logprob passes) is that of the distribution through them, above the mean's square."""
    points = {"min": 40.0, "p50": 500.0, "p90": 1800.0, "p99": 2800.0}

    def planned(path):
        status, out, _ = plan(capsys, DENSE, "--gpus", "8", "--lengths-from", str(path), "--json", "--top", "1")
        assert status == 0
        return json.loads(out)

    spread, flat = planned(_metrics(tmp_path / "spread.jsonl", **points)), planned(_metrics(tmp_path / "flat.jsonl"))
    # the quantile function linear between min, p50, p90, p99 and the longest, integrated by sampling it
    shares = np.linspace(0.0, 1.0, 1_000_001)
    lengths = 120 + np.interp(shares, [0, 0.5, 0.9, 0.99, 1], [*points.values(), 3000.0])
    assert spread["lengths"]["sequence_sq_mean"] == pytest.approx(np.mean(lengths ** 2), rel=1e-4)
    assert "sequence_sq_mean" not in flat["lengths"]  # a run that logged no percentiles: every sequence at the mean
    for phase in ("training", "logprobs"):
        assert spread["recipe"]["phases_s"][phase] > flat["recipe"]["phases_s"][phase]
    assert spread["recipe"]["phases_s"]["generation"] == flat["recipe"]["phases_s"]["generation"]
    # percentiles that fall are not lengths
    status, _, err = plan(capsys, DENSE, "--gpus", "8", "--lengths-from",
                          str(_metrics(tmp_path / "bad.jsonl", **{**points, "p90": 300.0})))
    assert status == 2 and "config key '--lengths-from'" in err and "do not rise" in err, err


def test_a_run_logs_its_response_lengths_percentiles():
    lengths = [5, 10, 20, 40, 80, 160, 320, 640, 900, 1000]
    trajectories = [Trajectory(Sample(prompt="p"), 0, GenerationResult(prompt_ids=[1], response_ids=[2] * n,
                                                                       response_logprobs=[-1.0] * n, finish_reason="stop"))
                    for n in lengths]
    metrics = rollout_metrics(trajectories)
    assert metrics["rollout/min_response_tokens"] == 5 and metrics["rollout/max_response_tokens"] == 1000
    assert metrics["rollout/p50_response_tokens"] == 120.0  # halfway between the 5th and 6th lengths
    assert metrics["rollout/p90_response_tokens"] == pytest.approx(910.0)
    assert metrics["rollout/p99_response_tokens"] == pytest.approx(991.0)


def test_the_decode_tail_bounds_generation(capsys):
    """The same mean response with its longest at the limit takes longer to generate than with every response
    at the mean, and training sees the same tokens."""
    def phases(*lengths):
        status, out, _ = plan(capsys, DENSE, "--gpus", "8", "--json", "--top", "1", "--response-tokens", "800", *lengths)
        assert status == 0
        return json.loads(out)["recipe"]["phases_s"]

    even, tail = phases("--response-max", "800"), phases()
    assert tail["generation"] > 2 * even["generation"]
    assert tail["training"] == pytest.approx(even["training"], rel=0.05)  # packing: the same tokens, filled budgets


@pytest.mark.parametrize("argv", [(DENSE, "--gpus", "8"), (MOE, "--gpus", "64", "--nodes", "8"),
                                  (DENSE, f"{MCFG}tensor_model_parallel_size=1", f"{MCFG}sequence_parallel=false",
                                   "--gpus", "1", "--gpu", "l40s", "--response-tokens", "700")])
def test_the_table_fits_120_columns_and_wide_shows_more(capsys, argv):
    status, out, _ = plan(capsys, *argv)
    assert status == 0 and "rlcore plan:" in out
    assert max(len(line) for line in out.splitlines()) <= 120
    status, wide, _ = plan(capsys, *argv, "--wide")
    assert status == 0 and "peak GiB (largest)" in wide and "peak GiB (largest)" not in out


@pytest.mark.parametrize("value", [-1.0, -1e-9, math.inf, math.nan])
def test_a_negative_or_infinite_time_is_never_printed(value):
    with pytest.raises(AssertionError, match="the planner computed a time"):
        seconds(value)
    assert seconds(0.0) == 0.0
