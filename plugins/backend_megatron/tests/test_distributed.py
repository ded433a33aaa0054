"""Megatron backend on CPU, gloo, 2 ranks: conversion parity, training step, export, resume.

One launch of two processes runs every scenario (dist_worker.py): imports dominate on a loaded
2-core machine. Tiny models use 4 query / 2 key-value heads so that TP=2 splits key/value groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlcore.testing.ranks import rank_results

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
WORKER = Path(__file__).with_name("dist_worker.py")


# Weights after one Adam step, compared between two paths that are equal up to fp32 rounding: Adam
# moves each weight by lr * g / (|g| + eps), about lr whatever the gradient's size, so a rounding
# difference d in a gradient entry near zero moves that weight by up to lr * d / eps (here eps 1e-6,
# d up to ~5e-8 for these gradients' sums): agreement within 5% of lr. A wrong or missing update
# moves a weight by about lr, 20 times that.
ADAM_LR = 1e-3  # dist_worker.backend_for's optimizer (adam_eps 1e-6)
WEIGHTS_TOL = 0.05 * ADAM_LR
# fp32 loss (~0.65: a mean over ~75 loss tokens of make_batch(n=8)) summed in another order across
# ranks, micro-batches or stages: N * eps32 * |loss| = 75 * 1.2e-7 * 0.65 ~ 6e-6. A normalization or
# missing-micro-batch bug moves it by percents.
LOSS_TOL = 1e-5
# Relative gradient-norm difference: a sum of ~1e6 fp32 squares in another (pairwise, per bucket)
# order, ~log2(N) * eps32 ~ 2.4e-6, plus the gradients' own rounding.
GRAD_NORM_RTOL = 1e-5
# fp32 logits and logprobs (|logp| <~ 8, where an ulp is 4.8e-7) from GEMMs over another number of rows, which
# may block the hidden-size (256) sum otherwise: ~sqrt(256) * eps32 * |logp| ~ 1e-5.
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def results(tiny_model_factory, tmp_path_factory):
    models = {a: str(tiny_model_factory(a, hidden_size=256, num_heads=4, num_kv_heads=2)) for a in ARCHS}
    out = tmp_path_factory.mktemp("megatron-dist")
    data = rank_results(WORKER, [json.dumps(models), out], out / "rank_0.json", what="megatron workers", timeout=420)
    errors = {k: v for k, v in data.items() if isinstance(v, str) and v.startswith("ERROR")}
    data["_errors"] = errors
    return data


def value(results, key):
    for name, err in results["_errors"].items():
        if key.startswith(name + "_") or key == name or (name == "training" and key not in results):
            pytest.fail(f"scenario {name} failed:\n{err}")
    assert key in results, f"{key} missing from worker results {sorted(results)}"
    return results[key]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_match_hugging_face(results, arch):
    assert value(results, f"tp2_{arch}") < 1e-4


def test_pp2_logits_match_hugging_face(results):
    assert value(results, "pp2_llama") < 1e-4


def test_ep2_moe_logits_match_hugging_face(results):
    assert value(results, "ep2_qwen3_moe") < 1e-4


def test_cp2_logprobs_match_hugging_face(results):
    # context parallelism: load-balanced chunks per sequence, K/V all-gathered over the CP group
    assert value(results, "cp2_logprobs_qwen2") < 1e-4


def test_training_step_matches_plain_pytorch_adamw(results):
    # DP=2 with the distributed optimizer vs one process: same loss, grad norm (gradients SUMMED over
    # data-parallel ranks) and updated weights in Hugging Face names.
    assert value(results, "train_loss") > 0.1
    assert value(results, "train_loss_diff") < LOSS_TOL
    assert value(results, "grad_norm_rel_diff") < GRAD_NORM_RTOL
    assert value(results, "train_weight_change") > 5e-4  # the step really moved the weights
    assert value(results, "train_weight_diff") < WEIGHTS_TOL
    assert value(results, "num_micro_batches") >= 2


def test_training_step_matches_fsdp2_backend(results):
    if str(results.get("fsdp2_compare", "")).startswith("SKIP"):
        pytest.skip(results["fsdp2_compare"])
    assert value(results, "fsdp2_compare_change") > 5e-4
    assert value(results, "fsdp2_compare_loss") < LOSS_TOL
    assert value(results, "fsdp2_compare_weights") < WEIGHTS_TOL


def test_export_reloads_into_transformers(results):
    assert value(results, "export_tensor_diff") == 0.0
    assert value(results, "export_logits_diff") < 1e-4


def test_logprobs_policy_and_reference(results):
    assert value(results, "ref_logprob_diff") < 1e-4  # reference = initial weights, after a step
    assert value(results, "policy_logprob_diff") < 1e-4


def test_resume_equals_uninterrupted(results):
    assert value(results, "resume_weight_diff") == 0.0
    assert value(results, "resume_loss_diff") == 0.0


def test_nonfinite_loss_skips_update(results):
    assert value(results, "nonfinite_skipped") == 1.0
    assert value(results, "nonfinite_weight_change") == 0.0


TRAIN_VARIANTS = ("tp2_sp_full_recompute_llama", "pp2_selective_recompute_llama", "tp2_qwen3", "tp2_sp_qwen2",
                  "ep2_qwen3_moe", "tp2_sp_qwen3_moe", "cp2_llama", "tp2_sp_ep2_etp1_qwen3_moe",
                  "tp2_sp_ep2_grouped_mm_qwen3_moe")


@pytest.mark.parametrize("variant", TRAIN_VARIANTS)
def test_parallel_layouts_train_like_one_process(results, variant):
    # TP (+ sequence parallel with our RMSNorm), PP schedules, expert parallel, context parallel
    # (all-gathered K/V), full/selective recompute: one optimizer step equals the plain single-process step.
    assert value(results, f"train_{variant}_loss") < LOSS_TOL
    assert value(results, f"train_{variant}_grad_norm") < GRAD_NORM_RTOL
    assert value(results, f"train_{variant}_weights") < WEIGHTS_TOL


def test_ep2_grouped_mm_experts_equal_the_expert_loop_and_resume(results):
    # EP=2: torch grouped GEMM experts (rlcore_megatron.moe_grouped_mm) vs the loop over experts from the
    # same weights; the checkpoint (expert axis sharded over the EP ranks) resumes bit for bit, and
    # reads into the loop over experts at EP=1 (what `rlcore export` does).
    assert value(results, "grouped_mm_ep2_logits") < LOGPROB_TOL
    assert value(results, "grouped_mm_ep2_logprobs") < LOGPROB_TOL
    assert value(results, "grouped_mm_ep2_loss") < LOSS_TOL
    assert value(results, "grouped_mm_ep2_grad_norm") < GRAD_NORM_RTOL
    assert value(results, "grouped_mm_ep2_names_equal") == 1.0
    assert value(results, "grouped_mm_ep2_change") > 5e-4  # the step really moved the weights
    assert value(results, "grouped_mm_ep2_weights") < WEIGHTS_TOL
    assert value(results, "grouped_mm_ep2_resume") == 0.0
    assert value(results, "grouped_mm_ep2_into_loop_ep1") == 0.0  # resharded from EP=2 into the loop at EP=1


POSITION_LAYOUTS = ("tp2_sp_llama", "cp2_llama", "pp2_llama")


@pytest.mark.parametrize("layout", POSITION_LAYOUTS)
def test_output_layer_on_the_loss_rows_equals_every_row(results, layout):
    # The output layer runs on the rows before loss-masked tokens only (sequence-gathered under SP,
    # each rank's own chunks under CP, the last stage under PP); fp32 logprobs there and one whole
    # training step equal the every-row path's, in the same layout from the same weights.
    key = f"positions_{layout}"
    assert value(results, f"{key}_rows_selected") == value(results, f"{key}_rows_needed")
    assert value(results, f"{key}_rows_selected") < 0.8 * value(results, f"{key}_rows_full")
    assert value(results, f"{key}_logprobs") < LOGPROB_TOL
    assert value(results, f"{key}_off_mask") == 0.0  # prompt tokens got no logits at all
    assert value(results, f"{key}_change") > 5e-4  # the step really moved the weights
    assert value(results, f"{key}_loss") < LOSS_TOL
    assert value(results, f"{key}_grad_norm") < GRAD_NORM_RTOL
    assert value(results, f"{key}_weights") < WEIGHTS_TOL


def test_releasing_the_state_to_host_memory_and_back_changes_nothing(results):
    """policy.generation.colocated.offload_trainer_state's round trip, DP=2 with the distributed optimizer: storages
    empty while out (weights kept for the refit, then released too), every tensor bitwise equal back, the next
    step the same to the bit as a backend that never released."""
    for key in ("out_True", "out_False", "equal_True", "equal_False", "loss_equal", "weights_equal", "state_equal"):
        assert value(results, f"release_dp2_{key}") is True, key
