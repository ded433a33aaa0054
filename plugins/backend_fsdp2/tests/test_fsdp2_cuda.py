"""CUDA-only checks of the fsdp2 backend (skipped without a GPU): the FlashAttention varlen path,
bf16 training, offload/onload and FSDP2 CPU offload on one device.

Runs without installing the distributions (the GPU machines have no package index)::

    PYTHONPATH=core/src:plugins/backend_fsdp2/src:plugins/backend_fsdp2/tests \
        python -m pytest -p no:cacheprovider plugins/backend_fsdp2/tests/test_fsdp2_cuda.py -q
"""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlcore.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-cuda"), "llama", num_heads=2, num_kv_heads=1)


def test_varlen_path_matches_per_sequence_sdpa():
    """Outputs and gradients of the varlen kernel (GQA, trailing padding) against fp32 SDPA per sequence."""
    from rlcore.training.attention import use_varlen
    from rlcore_fsdp2.attention import attention_cu_seqlens, varlen_attention_forward

    torch.manual_seed(0)
    lengths, pad = [37, 5, 120], 6
    total = sum(lengths) + pad
    q, k, v = (torch.randn(1, heads, total, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (8, 2, 2))
    assert use_varlen(q, 0.0), "FlashAttention's varlen kernel is not usable here"
    cu = torch.tensor([0, 37, 42, 162], dtype=torch.int32)
    acu, max_len = attention_cu_seqlens(cu, total, "cuda")
    got, _ = varlen_attention_forward(None, q, k, v, None, scaling=0.125, cu_seq_lens_q=acu, max_length_q=max_len)
    grad_out = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    start = 0
    for n in lengths + [pad]:
        sl = slice(start, start + n)
        parts = [x[:, :, sl].detach().float().requires_grad_() for x in (q, k, v)]
        want = torch.nn.functional.scaled_dot_product_attention(*parts, is_causal=True, scale=0.125, enable_gqa=True)
        assert float((got[0, sl].float() - want[0].transpose(0, 1)).abs().max()) < 2e-2
        want_grads = torch.autograd.grad(want, parts, grad_out[:, sl].float().transpose(1, 2))
        for name, g, w in zip("qkv", got_grads, want_grads):
            assert float((g[:, :, sl].float() - w).abs().max()) < 5e-2, f"d{name} of sequence at {start}"
        start += n


# The default learning rate (1e-6) moves no bf16 weight by a single ulp (spacing ~2e-4 at the init
# std 0.05), so a step there could not be told from no step. A large Adam eps keeps the update
# linear in the gradient (lr * g / eps for |g| << eps): each weight moves by about its (clipped)
# gradient, the clipping factor shows in the update (Adam alone is blind to gradient scale), and a
# rounding difference in a near-zero gradient stays a rounding difference instead of flipping an
# lr-sized sign(g) step.
LR, EPS = 1e-2, 1e-2


def _backend(model_dir, precision="bfloat16", max_grad_norm=1.0, **dtensor):
    from rlcore.config.schema import OptimizerConfig, PolicyConfig, RunConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig

    cfg = DTensorConfig(**dtensor)
    policy = PolicyConfig(model_name=str(model_dir), precision=precision, max_grad_norm=max_grad_norm,
                          optimizer=OptimizerConfig(lr=LR, eps=EPS),
                          sequence_packing=SequencePackingConfig(train_mb_tokens=64, logprob_mb_tokens=64))
    return FSDP2Backend(RunConfig(policy=policy, sections={SECTION: cfg}), cfg, WorldInfo(device="cuda"))


def _batch():
    from rlcore.interfaces import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 100, (n,), generator=g) for n in (20, 33, 9, 40)]
    return SequenceBatch(input_ids=ids, loss_mask=[torch.ones_like(x, dtype=torch.float32) for x in ids])


@pytest.mark.parametrize("dtensor", [{}, {"cpu_offload": True}, {"activation_checkpointing": True, "compile": True}])
def test_bf16_backend_trains_offloads_and_matches_hf(single_cuda_process_group, model_dir, dtensor):
    from _fsdp2_common import hf_logprobs, load_hf
    from rlcore.algorithms.sft import SFT  # direct import: the GPU machines run without installed entry points

    backend = _backend(model_dir, **dtensor)
    batch = _batch()
    before = backend.logprobs(batch)
    hf = load_hf(model_dir)
    with torch.no_grad():
        for got, ids in zip(before, batch.input_ids):
            assert float((got - hf_logprobs(hf, ids)).abs().max()) < 0.1  # bf16 compute vs fp32 reference
    metrics = backend.train(batch, SFT())
    assert "skipped_nonfinite" not in metrics and metrics["grad_norm"] > 0
    trained = backend.logprobs(batch)
    # the SFT step raised the trained tokens' logprobs by far more than bf16 noise (~1e-2 of |logp|),
    # so the reference check below can tell the initial weights from the trained ones
    gain = float(sum(t[1:].sum() - b[1:].sum() for t, b in zip(trained, before))) / sum(len(x) - 1 for x in batch.input_ids)
    print(f"bf16 step {dtensor}: mean logprob gain {gain:.3f}")
    assert gain > 0.1, gain
    allocated = torch.cuda.memory_allocated()
    backend.offload()
    if not dtensor.get("cpu_offload"):
        assert torch.cuda.memory_allocated() < allocated
    backend.onload()
    for a, b in zip(trained, backend.logprobs(batch)):
        assert torch.equal(a, b)
    for a, b in zip(before, backend.logprobs(batch, reference=True)):
        assert torch.equal(a, b)
    chunks = list(backend.export_weights(dtype="bfloat16"))
    assert all(t.dtype == torch.bfloat16 and t.is_cuda for chunk in chunks for _, t in chunk)
    backend.shutdown()


def test_clipping_and_nonfinite_skip_on_the_device_match_the_host_path(single_cuda_process_group, model_dir):
    """The fused optimizer clips (grad_scale) and skips non-finite steps (found_inf) on the GPU; with
    CPU offload the same step is read, clipped and skipped on the host. fp32, clipping active."""
    from _fsdp2_common import load_hf
    from rlcore.algorithms.sft import SFT

    class NaNLoss(SFT):  # a fault injected on purpose
        def loss(self, logprobs_T, mb, totals):
            loss, metrics = super().loss(logprobs_T, mb, totals)
            return loss * float("nan"), metrics

    results = []
    for dtensor in ({}, {"cpu_offload": True}):
        backend = _backend(model_dir, precision="float32", max_grad_norm=0.05, **dtensor)
        assert bool(backend.optimizer.defaults.get("fused")) == (not dtensor)
        metrics = backend.train(_batch(), SFT())
        params = {n: t.float().cpu() for chunk in backend.export_weights() for n, t in chunk}
        skipped = backend.train(_batch(), NaNLoss())
        after_nan = {n: t.float().cpu() for chunk in backend.export_weights() for n, t in chunk}
        results.append((metrics, params, skipped, after_nan, backend.step))
        backend.shutdown()
    (dev_metrics, dev_params, dev_skip, dev_after, dev_step), (host_metrics, host_params, host_skip, host_after, host_step) = results
    assert dev_metrics["grad_norm"] > 0.05 * 10  # clipping did something
    assert dev_metrics["grad_norm"] == pytest.approx(host_metrics["grad_norm"], rel=1e-5)
    # In Adam's linear regime (LR, EPS above) the update is LR / EPS times the clipped gradient, so
    # an unclipped or wrongly scaled step differs by the whole update (here 10x); fp32 rounding of
    # the fused kernel against the host loop is ~1e-6 of it.
    initial = {n: t.float() for n, t in load_hf(model_dir).state_dict().items()}
    moved = max(float((dev_params[n] - initial[n]).abs().max()) for n in dev_params)
    diff = max(float((dev_params[n] - host_params[n]).abs().max()) for n in dev_params)
    print(f"device vs host clipped step: weights differ by {diff:.2e}, moved up to {moved:.2e}")
    assert moved > 1e-4 and diff < 1e-3 * moved, (diff, moved)
    assert dev_skip["skipped_nonfinite"] == host_skip["skipped_nonfinite"] == 1.0
    assert all(torch.equal(dev_params[n], dev_after[n]) for n in dev_params)
    assert all(torch.equal(host_params[n], host_after[n]) for n in host_params)
    assert dev_step == host_step == 1


def test_compiled_layers_with_traced_attention_train_like_eager(single_cuda_process_group, model_dir):
    """``compile: true`` traces the varlen attention into each layer's graph; the step must match eager."""
    from rlcore.algorithms.sft import SFT

    results = []
    for dtensor in ({}, {"compile": True}):
        backend = _backend(model_dir, **dtensor)
        batch = _batch()
        before = backend.logprobs(batch)
        metrics = backend.train(batch, SFT())
        results.append((before, metrics, backend.logprobs(batch)))
        backend.shutdown()
    (eager_before, eager_metrics, eager_after), (comp_before, comp_metrics, comp_after) = results
    moved = max(float((a - b).abs().max()) for a, b in zip(eager_after, eager_before))
    print(f"compiled vs eager: the step moved logprobs by up to {moved:.3f}")
    assert moved > 0.5  # the comparison after the step can tell a wrong update (10x the tolerance)
    for a, b in zip(eager_before + eager_after, comp_before + comp_after):
        assert float((a - b).abs().max()) < 0.05  # bf16: fused kernels round differently
    assert comp_metrics["grad_norm"] == pytest.approx(eager_metrics["grad_norm"], rel=0.02)
    assert comp_metrics["loss"] == pytest.approx(eager_metrics["loss"], rel=0.01)


def test_fused_token_logprobs_match_eager_on_a_large_vocabulary():
    from rlcore.training import ops

    torch.manual_seed(0)
    T, V = 700, 128256
    logits = (3 * torch.randn(T, V, device="cuda")).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (T,), device="cuda")
    cu = torch.tensor([0, 300, 650], dtype=torch.int32)
    w = torch.randn(T, device="cuda")
    outs = []
    for fused in (False, True):
        out = ops.token_logprobs(logits, ids, cu, chunk_tokens=256, fused=fused)
        (grad,) = torch.autograd.grad((out * w).sum(), logits)
        outs.append((out, grad.float()))
    assert not ops._KERNELS.failed
    assert float((outs[0][0] - outs[1][0]).abs().max()) < 1e-4
    assert float((outs[0][1] - outs[1][1]).abs().max()) < 1e-3 * float(outs[0][1].abs().max())
