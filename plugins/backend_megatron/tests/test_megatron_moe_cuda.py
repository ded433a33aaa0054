"""CUDA-only checks of the Megatron backend's MoE fast path (skipped without a GPU or Transformer Engine).

On an H200, with the staged wheels and rlcore's own installed (benchmarks/gpu/README.md)::

    python3 -m pytest -p no:cacheprovider plugins/backend_megatron/tests/test_megatron_moe_cuda.py -q

- grouped GEMM (TE's grouped linear, with the split sizes on the GPU as rlcore_megatron.moe_splits
  builds it, and with Megatron's host split sizes) with fused permute/unpermute gives the logprobs of the loop
  over experts in bf16 (mean |diff| < 0.02, max < 0.15: the tolerance of the bf16 TE-vs-HF check in
  test_megatron_cuda.py; a wrong expert order or weight layout differs by order 1) and the same
  training step in fp32 (TE's fp32 GEMMs round like TF32: loss < 1e-3, gradient norm < 5e-3
  relative, weights within 2% of the update);
- routing replay R2 on the TE spec in bf16: every token trains with its recorded experts while the
  router's own choice moved (the CPU test's check, routing_replay_worker.py);
- torch grouped GEMM experts (``moe_experts_impl: grouped_mm``, what ``auto`` picks in bf16; no TE
  needed) give the loop's logprobs in bf16 within the same tolerance, and in fp32 (where they run
  as a loop of matmuls: torch's CUDA grouped GEMM is bf16 only) the loop's training step within
  fp32 rounding (TF32 off).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import SumNLL, make_batch  # noqa: E402
from test_megatron_cuda import (  # noqa: E402,F401 - fixtures by name
    _exact_fp32, cuda_backend, exported, exported_initial, max_diff, mean_diff, te_loads)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def moe_path(tiny_model_factory):
    return str(tiny_model_factory("qwen3_moe", hidden_size=256, num_heads=4, num_kv_heads=2))


def expert_modules(backend) -> set[str]:
    names = ("DeviceSplitsGroupedMLP", "TEGroupedMLP", "GroupedMLP", "SequentialMLP", "GroupedMMExperts")
    return {type(m).__name__ for m in backend.module.modules() if type(m).__name__ in names}


LOOP = {"moe_grouped_gemm": False, "moe_permute_fusion": False}
TE_GROUPED = {"moe_experts_impl": "te_grouped"}
HOST_SPLITS = {**TE_GROUPED, "moe_device_splits": False}  # Megatron's own TEGroupedMLP: host split sizes, per-expert launches
MODULES = {"grouped": {"DeviceSplitsGroupedMLP"}, "grouped-host": {"TEGroupedMLP"}, "loop": {"SequentialMLP"}}


def test_grouped_gemm_logprobs_equal_the_expert_loop_bf16(single_cuda_process_group, te_loads, moe_path):
    batch = make_batch(2)
    results = {}
    for name, keys in (("grouped", TE_GROUPED), ("grouped-host", HOST_SPLITS), ("loop", LOOP)):
        backend = cuda_backend(moe_path, "bfloat16", transformer_impl="transformer_engine", **keys)
        assert backend.kernels.moe_grouped_gemm == (name != "loop"), backend.kernels.describe()
        assert backend.kernels.moe_device_splits == (name == "grouped"), backend.kernels.describe()
        assert expert_modules(backend) == MODULES[name], expert_modules(backend)
        results[name] = backend.logprobs(batch)
        backend.shutdown()
    for name in ("grouped", "grouped-host"):
        gap = max_diff(results[name], results["loop"]), mean_diff(results[name], results["loop"])
        print(f"qwen3_moe bf16: {name} GEMM vs loop over experts, logprobs |diff| max/mean {gap}")
        assert gap[0] < 0.15 and gap[1] < 0.02, (name, gap)


def test_grouped_gemm_training_step_equals_the_expert_loop_fp32(single_cuda_process_group, te_loads, moe_path):
    batch = make_batch(5, n=8)
    results = {}
    for name, keys in (("grouped", TE_GROUPED), ("loop", LOOP)):
        backend = cuda_backend(moe_path, transformer_impl="transformer_engine", optimizer={
            "optimizer": "sgd", "lr": 0.5, "sgd_momentum": 0.0, "use_distributed_optimizer": False}, **keys)
        results[name] = backend.train(batch, SumNLL()), exported(backend)
        backend.shutdown()
    (m_g, w_g), (m_l, w_l) = results["grouped"], results["loop"]
    assert set(w_g) == set(w_l)  # the grouped layout exports the same per-expert Hugging Face names
    loss_diff = abs(m_g["loss"] - m_l["loss"])
    norm_diff = abs(m_g["grad_norm"] - m_l["grad_norm"]) / m_l["grad_norm"]
    weight_diff = max(float((w_g[k] - w_l[k]).abs().max()) for k in w_l)
    initial = exported_initial(moe_path)
    moved = max(float((w_g[k] - initial[k]).abs().max()) for k in initial)
    print(f"grouped vs loop training step (fp32): loss {loss_diff:.2e}, grad norm {norm_diff:.2e} rel, "
          f"weights {weight_diff:.2e} (moved up to {moved:.2e})")
    assert loss_diff < 1e-3 and norm_diff < 5e-3 and weight_diff < 2e-2 * moved, (loss_diff, norm_diff, weight_diff, moved)


def test_routing_replay_r2_on_transformer_engine_bf16(single_cuda_process_group, te_loads, moe_path):
    from routing_replay_worker import scenario

    result = scenario(moe_path, device="cuda", precision="bfloat16", transformer_impl="transformer_engine",
                      moe_router_replay="r2", **TE_GROUPED)
    print(f"R2 on TE, bf16: {result}")
    assert "grouped GEMM" in result["kernels"]
    assert result["optimizer_steps"] == 2.0 and result["differing_calls"] == 0 and result["mismatched"] > 0, result


def test_grouped_mm_experts_logprobs_equal_the_expert_loop_bf16(single_cuda_process_group, moe_path):
    batch = make_batch(2)
    results = {}
    for name, keys in (("grouped_mm", {}), ("loop", {"moe_experts_impl": "loop"})):  # auto: grouped_mm in bf16
        backend = cuda_backend(moe_path, "bfloat16", transformer_impl="local", **keys)
        assert backend.kernels.moe_experts == name, backend.kernels.describe()
        assert expert_modules(backend) == ({"GroupedMMExperts"} if name == "grouped_mm" else {"SequentialMLP"})
        results[name] = backend.logprobs(batch)
        backend.shutdown()
    gap = max_diff(results["grouped_mm"], results["loop"]), mean_diff(results["grouped_mm"], results["loop"])
    print(f"qwen3_moe bf16: torch grouped_mm experts vs loop over experts, logprobs |diff| max/mean {gap}")
    assert gap[0] < 0.15 and gap[1] < 0.02, gap


def test_grouped_mm_experts_fp32_training_step_equals_the_expert_loop(single_cuda_process_group, _exact_fp32, moe_path):
    batch = make_batch(5, n=8)
    results = {}
    for impl in ("grouped_mm", "loop"):
        backend = cuda_backend(moe_path, transformer_impl="local", moe_experts_impl=impl, optimizer={
            "optimizer": "sgd", "lr": 0.5, "sgd_momentum": 0.0, "use_distributed_optimizer": False})
        results[impl] = backend.train(batch, SumNLL()), exported(backend)
        backend.shutdown()
    (m_g, w_g), (m_l, w_l) = results["grouped_mm"], results["loop"]
    assert set(w_g) == set(w_l)
    weight_diff = max(float((w_g[k] - w_l[k]).abs().max()) for k in w_l)
    initial = exported_initial(moe_path)
    moved = max(float((w_g[k] - initial[k]).abs().max()) for k in initial)
    print(f"grouped_mm (fp32 loop fallback) vs loop training step: loss {abs(m_g['loss'] - m_l['loss']):.2e}, "
          f"weights {weight_diff:.2e} (moved up to {moved:.2e})")
    assert abs(m_g["loss"] - m_l["loss"]) < 1e-5 and abs(m_g["grad_norm"] - m_l["grad_norm"]) / m_l["grad_norm"] < 1e-4
    assert moved > 1e-3 and weight_diff < 1e-3 * moved, (weight_diff, moved)
