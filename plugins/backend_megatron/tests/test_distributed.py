"""Megatron backend on CPU, gloo, 2 ranks: conversion parity, training step, export, resume.

One launch of two processes runs every scenario (dist_worker.py): imports dominate on a loaded
2-core machine. Tiny models use 4 query / 2 key-value heads so that TP=2 splits key/value groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlcore.testing.ranks import rank_results

pytestmark = pytest.mark.slow

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
# LoRA (dist_worker.check_lora_*): the loss there is ~1.9 over ~75 tokens: 75 * 1.2e-7 * 1.9 ~ 2e-5.
LORA_LOSS_TOL = 2e-5
# An adapter gradient entry sums products over the tokens (~75) and, before that, over the hidden (256) or
# intermediate (512) size, which TP/SP/PP split or reorder; fp32 rounding of such a sum is ~sqrt(N) * eps32 of the
# sum of its terms' magnitudes, which cancellation (advantages of both signs) makes 10-100x the result: 1e-4 of the
# largest gradient. A wrong shard, row order or missing reduction is off by the gradient's own size.
LORA_GRAD_RTOL = 1e-4
# Adapters after one Adam step (lr 1e-2, eps 1e-3): a gradient difference d moves an entry by at most lr * d / eps
# (~3e-5 for d ~ 3e-6, the differences seen); 5% of lr, as WEIGHTS_TOL. A wrong update moves it by ~lr.
LORA_LR = 1e-2
LORA_WEIGHTS_TOL = 0.05 * LORA_LR
# fp32 logits and logprobs (|logp| <~ 8, where an ulp is 4.8e-7) from GEMMs over another number of rows, which
# may block the hidden-size (256) sum otherwise: ~sqrt(256) * eps32 * |logp| ~ 1e-5.
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def results(tiny_model_factory, tmp_path_factory):
    models = {a: str(tiny_model_factory(a, hidden_size=256, num_heads=4, num_kv_heads=2)) for a in ARCHS}
    out = tmp_path_factory.mktemp("megatron-dist")
    data = rank_results(WORKER, [json.dumps(models), out], out / "rank_0.json", what="megatron workers", timeout=600)
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


@pytest.mark.parametrize("layout", ("tp2", "tp2_sp", "pp2", "cp2"))
def test_lora_layouts_equal_one_process(results, layout):
    """LoRA on every projection from the same nonzero adapters, one step: TP=2 (with and without sequence
    parallelism), PP=2 and CP=2 give TP=1's loss, adapter gradients (gathered whole, PEFT names) and adapters after
    the step; the merged weights each layout exports are its adapters merged into the base in fp32."""
    grad_max = value(results, "lora_layouts_grad_max")
    assert value(results, "lora_layouts_grad_min") > 1e-3  # every adapter, A and B, got a gradient
    assert value(results, "lora_layouts_change") > 0.5 * LORA_LR  # the step moved the adapters
    assert value(results, "lora_layouts_merge") < 1e-6
    assert value(results, f"lora_layouts_{layout}_loss") < LORA_LOSS_TOL
    assert value(results, f"lora_layouts_{layout}_grads") < LORA_GRAD_RTOL * grad_max
    assert value(results, f"lora_layouts_{layout}_adapters") < LORA_WEIGHTS_TOL
    assert value(results, f"lora_layouts_{layout}_merge") < 1e-6


def test_lora_equals_fsdp2_peft(results):
    """The same tiny model, batch and adapters through the fsdp2 backend (PEFT's layers, one adapter per q/k/v and
    gate/up projection) and Megatron's fused linear_qkv / linear_fc1 adapters, DP=2: same loss and adapter gradients."""
    if str(results.get("fsdp2_compare", "")).startswith("SKIP"):
        pytest.skip(results["fsdp2_compare"])
    assert value(results, "lora_fsdp2_grad_min") > 1e-3
    assert value(results, "lora_fsdp2_loss") < LORA_LOSS_TOL
    assert value(results, "lora_fsdp2_grads") < LORA_GRAD_RTOL * value(results, "lora_layouts_grad_max")


def test_lora_export_reference_and_resume(results):
    """Only the adapters train (DP=2, distributed optimizer); the reference is the base model; the merged export and
    the PEFT adapter (loaded by peft onto the base) give the trained model's logprobs; the checkpoint holds the
    adapters alone and resumes to the same step, bit for bit."""
    assert value(results, "lora_export_resume_only_adapters_train") is True
    assert value(results, "lora_export_resume_reference") < LOGPROB_TOL
    assert value(results, "lora_export_resume_moved") > 1e-2
    assert value(results, "lora_export_resume_peft") < LOGPROB_TOL
    assert value(results, "lora_export_resume_merged") < LOGPROB_TOL
    assert value(results, "lora_export_resume_ckpt_adapters") == 28  # 2 layers x 7 projections x (A, B)
    assert value(results, "lora_export_resume_ckpt_not_adapters") == []
    assert value(results, "lora_export_resume_resume_weights") == 0.0
    assert value(results, "lora_export_resume_resume_loss") == 0.0


def test_lora_bf16_base_has_no_main_weights(results):
    """bf16 LoRA: the frozen base stays bf16 outside the gradient buffers; the optimizer's fp32 main weights (and
    so its state) cover exactly the adapters; releasing the trainer's state to host memory takes the base too."""
    assert value(results, "lora_bf16_base_released") is True
    assert value(results, "lora_bf16_base_back") is True
    assert value(results, "lora_bf16_base_bf16") is True
    assert value(results, "lora_bf16_main_fp32") is True
    assert value(results, "lora_bf16_main_numel") == value(results, "lora_bf16_adapter_numel") > 0
