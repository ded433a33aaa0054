"""rlcore_megatron.moe_grouped_mm on CPU, one process (EP=1): torch's grouped GEMM experts give the
logprobs and the training step of Megatron's loop over experts (``SequentialMLP``), their Hugging
Face export reloads into transformers with the same logprobs, and a checkpoint resumes to the same
weights. EP=2 (2 gloo ranks) is in test_distributed.py and test_routing_replay.py; bf16 on CUDA in
test_megatron_moe_cuda.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import SumNLL, backend_for, exported, make_batch, max_diff, on_mask  # noqa: E402

from rlcore.config import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def moe_path(tiny_model_factory):
    return str(tiny_model_factory("qwen3_moe"))


def expert_modules(backend) -> set[str]:
    return {type(m).__name__ for m in backend.module.modules() if type(m).__name__ in ("GroupedMMExperts", "SequentialMLP")}


@pytest.fixture(scope="module")
def trained(single_process_group, moe_path):
    """For each experts implementation: logprobs before, the step's metrics, logprobs and HF weights after."""
    results = {}
    for impl in ("loop", "grouped_mm"):
        backend = backend_for(moe_path, moe_experts_impl=impl)
        assert backend.kernels.moe_experts == impl, backend.kernels.describe()
        assert expert_modules(backend) == {"GroupedMMExperts" if impl == "grouped_mm" else "SequentialMLP"}
        before = backend.logprobs(make_batch(3, n=8))
        metrics = backend.train(make_batch(4, n=8), SumNLL())
        results[impl] = {"before": before, "metrics": metrics, "after": backend.logprobs(make_batch(3, n=8)),
                         "weights": exported(backend), "backend": backend}
    yield results
    for r in results.values():
        r["backend"].shutdown()


def test_grouped_mm_experts_hold_stacked_expert_weights(trained):
    module = next(m for m in trained["grouped_mm"]["backend"].module.modules() if type(m).__name__ == "GroupedMMExperts")
    cfg = module.config
    assert tuple(module.linear_fc1.weight.shape) == (cfg.num_moe_experts, 2 * cfg.moe_ffn_hidden_size, cfg.hidden_size)
    assert tuple(module.linear_fc2.weight.shape) == (cfg.num_moe_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size)
    assert module.linear_fc1.weight.allreduce  # EP=1: reduced with the dense weights, as Megatron's experts are


def test_grouped_mm_logprobs_and_training_step_equal_the_expert_loop(trained):
    loop, grouped = trained["loop"], trained["grouped_mm"]
    assert max_diff(loop["before"], grouped["before"]) < 1e-5
    assert abs(loop["metrics"]["loss"] - grouped["metrics"]["loss"]) < 1e-5
    assert abs(loop["metrics"]["grad_norm"] - grouped["metrics"]["grad_norm"]) / loop["metrics"]["grad_norm"] < 1e-5
    assert set(loop["weights"]) == set(grouped["weights"])  # the same per-expert Hugging Face names
    # one Adam step (lr 1e-3, eps 1e-6): rounding of near-zero gradients moves weights by up to ~5% of lr
    # (test_distributed.WEIGHTS_TOL says why); a wrong update moves them by about lr
    assert max(float((loop["weights"][k] - grouped["weights"][k]).abs().max()) for k in loop["weights"]) < 0.05 * 1e-3
    # logprobs after the step: fp32 forward rounding, as before it; the few near-zero-gradient weights
    # that may differ (by < 5% of lr) each carry a ~1/num_weights share of the step's effect
    assert max_diff(loop["after"], grouped["after"]) < 1e-5
    assert max_diff(grouped["before"], grouped["after"]) > 1e-4  # the step moved the weights


def test_grouped_mm_bf16_logprobs_equal_the_expert_loop(single_process_group, moe_path):
    """bf16 as on the GPU (the kernel serves any dtype on CPU): the activation, the router
    probability (fp32) and the casts between them round as in Megatron's expert MLP."""
    from rlcore.config import RunConfig
    from rlcore.config.schema import PolicyConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import build_backend
    from rlcore_megatron.config import MegatronConfig

    policy = PolicyConfig(model_name=moe_path, precision="bfloat16",
                          sequence_packing=SequencePackingConfig(train_mb_tokens=40, logprob_mb_tokens=40))
    logprobs = {}
    for impl in ("loop", "grouped_mm"):
        backend = build_backend(RunConfig(policy=policy), MegatronConfig(enabled=True, moe_experts_impl=impl), WorldInfo())
        logprobs[impl] = backend.logprobs(make_batch(3, n=8))
        backend.shutdown()
    assert logprobs["loop"][0].dtype == torch.float32  # logprobs of bf16 logits
    # The same bf16 products (fp32 accumulation, one rounding each) and the same casts: an output element
    # may land one bf16 ulp (2^-8 relative) apart where the accumulation order differs, a ~1e-4 change in
    # a logprob; a cast in another place shifts every element by up to an ulp, ~1e-2 in the logprobs.
    assert max_diff(logprobs["loop"], logprobs["grouped_mm"]) < 1e-3


def test_grouped_mm_export_reloads_into_transformers(trained, tmp_path):
    from rlcore.training.ops import token_logprobs
    from transformers import AutoModelForCausalLM

    grouped = trained["grouped_mm"]
    grouped["backend"].export_hf(str(tmp_path / "export"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    batch = make_batch(3, n=8)
    with torch.no_grad():
        ref = [token_logprobs(hf(ids[None]).logits[0], ids) for ids in batch.input_ids]
    assert max_diff(on_mask(grouped["after"], batch), on_mask(ref, batch)) < 1e-5


def test_grouped_mm_checkpoint_resumes_and_reads_into_the_loop(trained, moe_path, tmp_path):
    backend = trained["grouped_mm"]["backend"]
    backend.save_checkpoint(str(tmp_path / "ckpt"))
    backend.train(make_batch(5, n=8), SumNLL())
    uninterrupted = exported(backend)
    fresh = backend_for(moe_path, moe_experts_impl="grouped_mm")
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert max(float((trained["grouped_mm"]["weights"][k] - v).abs().max()) for k, v in exported(fresh).items()) == 0.0
    fresh.train(make_batch(5, n=8), SumNLL())
    resumed = exported(fresh)
    fresh.shutdown()
    assert max(float((uninterrupted[k] - resumed[k]).abs().max()) for k in uninterrupted) == 0.0
    # the model part reads into the loop over experts too (what `rlcore export` builds on a CPU)
    from rlcore_megatron import checkpoint, cpu_shims

    loop = backend_for(moe_path, moe_experts_impl="loop")
    with cpu_shims.active():
        checkpoint.load_model(loop, str(tmp_path / "ckpt"))
    assert max(float((trained["grouped_mm"]["weights"][k] - v).abs().max()) for k, v in exported(loop).items()) == 0.0
    loop.shutdown()


def test_loop_fallback_equals_the_grouped_kernel_with_empty_experts(trained, monkeypatch):
    """The matmul loop that serves CUDA outside bf16 gives the kernel's output and gradients
    (empty experts included; the kernel is switched off here as it is for fp32 on CUDA)."""
    from rlcore_megatron import moe_grouped_mm

    module = next(m for m in trained["grouped_mm"]["backend"].module.modules() if isinstance(m, moe_grouped_mm.GroupedMMExperts))
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 0]
    hidden_TH = torch.randn(sum(counts), module.config.hidden_size, generator=g)
    probs_T = torch.rand(sum(counts), generator=g)

    def run(hidden_TH=hidden_TH, counts=counts, probs_T=probs_T):
        out, bias = module(hidden_TH, torch.tensor(counts), probs_T)
        # autograd.grad: the DDP wrapper's gradient hooks (main_grad buffers) stay out of it
        grad_fc1, grad_fc2 = torch.autograd.grad(out.square().sum(), [module.linear_fc1.weight, module.linear_fc2.weight])
        return out.detach(), grad_fc1, grad_fc2, bias

    kernel = run()
    monkeypatch.setattr(moe_grouped_mm, "uses_kernel", lambda device, dtype: False)
    loop = run()
    assert kernel[3] is None and loop[3] is None
    for a, b in zip(kernel[:3], loop[:3]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert float(kernel[1][1].abs().max()) == 0.0 and float(kernel[1][0].abs().max()) > 0  # expert 1 got no tokens
    # no token on this rank at all (EP): an empty output, and zero gradients for every expert weight
    out_TH, grad_fc1, grad_fc2, _ = run(hidden_TH[:0], [0, 0, 0, 0], probs_T[:0])
    assert out_TH.shape == (0, module.config.hidden_size) and not grad_fc1.any() and not grad_fc2.any()


def test_experts_impl_resolution(monkeypatch):
    from rlcore.config import structure
    from rlcore_megatron import kernels
    from rlcore_megatron.config import SECTION, MegatronConfig

    def make(**data):
        return structure(MegatronConfig, data, SECTION)

    assert kernels.resolve(make(), on_cuda=False).moe_experts == "loop"  # auto on CPU: today's choice
    cpu = kernels.resolve(make(moe_experts_impl="grouped_mm"), on_cuda=False)
    assert cpu.moe_experts == "grouped_mm" and cpu.moe_device_splits and not cpu.moe_grouped_gemm
    assert "torch grouped_mm" in cpu.describe()
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.moe_experts_impl.*needs Transformer Engine"):
        kernels.resolve(make(moe_experts_impl="te_grouped"), on_cuda=False)
    monkeypatch.setattr(kernels, "transformer_engine", lambda: {"version": "2.20.2", "loads": True, "error": None})
    monkeypatch.setattr(kernels, "grouped_mm_available", lambda on_cuda: True)
    assert kernels.resolve(make(), on_cuda=True, bf16=True).moe_experts == "grouped_mm"
    assert kernels.resolve(make(), on_cuda=True, bf16=False).moe_experts == "te_grouped"  # fp32: TE's grouped linear
    assert kernels.resolve(make(expert_tensor_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
                           on_cuda=True, bf16=True).moe_experts == "te_grouped"
    assert kernels.resolve(make(fp8_cfg={"enabled": True}), on_cuda=True, bf16=True).moe_experts == "te_grouped"
    assert kernels.resolve(make(moe_grouped_gemm=False), on_cuda=True, bf16=True).moe_experts == "loop"  # the older key
    assert kernels.resolve(make(moe_grouped_gemm=True), on_cuda=True, bf16=True).moe_experts == "te_grouped"
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.expert_tensor_parallel_size.*is 2"):
        kernels.resolve(make(moe_experts_impl="grouped_mm", expert_tensor_parallel_size=2), on_cuda=True, bf16=True)
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.moe_grouped_gemm.*moe_experts_impl is 'grouped_mm'"):
        kernels.resolve(make(moe_experts_impl="grouped_mm", moe_grouped_gemm=True), on_cuda=True, bf16=True)
    monkeypatch.setattr(kernels, "grouped_mm_available", lambda on_cuda: False)
    assert kernels.resolve(make(), on_cuda=True, bf16=True).moe_experts == "te_grouped"
    with pytest.raises(ConfigError, match=r"moe_experts_impl.*needs torch\.nn\.functional\.grouped_mm"):
        kernels.resolve(make(moe_experts_impl="grouped_mm"), on_cuda=True, bf16=True)
