"""CUDA-only checks of the Megatron backend on Transformer Engine (skipped without a GPU or TE).

On the H200 machines, with the staged wheels and rlcore's own installed (benchmarks/gpu/README.md)::

    python3 -m pytest -p no:cacheprovider plugins/backend_megatron/tests/test_megatron_cuda.py -q

- TE-spec logprobs equal the Hugging Face model's for Llama, Qwen2, Qwen3 and Qwen3-MoE, in fp32
  (TF32 off) and, for Llama, in bf16 within a stated tolerance;
- a TE-spec training step (fused weight-gradient accumulation on) equals the local spec's on the
  same batch and initial weights, in fp32;
- FP8 (tensorwise and delayed) trains on packed micro-batches of any length (padded to the GEMM
  row multiple) and its logprobs stay near bf16's;
- TE's own attention (cuDNN) gives the same logprobs as the flash path;
- the MLP through TE's op fuser equals the module MLP;
- ``experimental.gemm_sm_margin``: the backend's GEMMs (TE's and torch's) target fewer SMs and give
  the same logprobs within bf16 rounding; a margin of every SM is refused by name; shutdown restores
  the process-wide settings;
- ``cuda_graph: micro_batch`` (bf16, ``sft`` and GRPO; FP8 is refused): graphed steps with replays
  over micro-batches of different lengths equal the same padded path run eagerly and Megatron's
  schedule within the stated tolerances, metrics included.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import SumNLL, make_batch, on_mask  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")


@pytest.fixture(scope="module", autouse=True)
def _exact_fp32():
    """fp32 comparisons mean fp32: no TF32 in cuBLAS or cuDNN (TE's GEMMs follow torch's flag)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def te_loads():
    from rlcore.training.doctor import transformer_engine

    status = transformer_engine()
    if not status["loads"]:
        pytest.skip(f"Transformer Engine does not load: {status['error']}")


def cuda_backend(path: str, precision: str = "float32", **mcfg):
    from rlcore.config import RunConfig, structure
    from rlcore.config.schema import OptimizerConfig, PolicyConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import build_backend
    from rlcore_megatron.config import SECTION, MegatronConfig

    policy = PolicyConfig(model_name=path, precision=precision, max_grad_norm=1.0,
                          optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.01, eps=1e-6),
                          sequence_packing=SequencePackingConfig(train_mb_tokens=64, logprob_mb_tokens=64))
    cfg = structure(MegatronConfig, {"enabled": True, **mcfg}, SECTION)
    return build_backend(RunConfig(policy=policy), cfg, WorldInfo(device="cuda"))


def hf_logprobs(path: str, batch, dtype=torch.float32) -> list[torch.Tensor]:
    from rlcore.training.ops import token_logprobs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda()
    with torch.no_grad():
        return [token_logprobs(model(ids[None].cuda()).logits[0], ids.cuda(), fused=False).cpu() for ids in batch.input_ids]


def max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def mean_diff(a, b) -> float:
    return float(torch.cat([(x.float() - y.float()).abs() for x, y in zip(a, b)]).mean())


@pytest.mark.parametrize("arch", ARCHS)
def test_te_spec_logprobs_equal_hugging_face_fp32(single_cuda_process_group, te_loads, tiny_model_factory, arch):
    path = str(tiny_model_factory(arch, hidden_size=256, num_heads=4, num_kv_heads=2))
    backend = cuda_backend(path, transformer_impl="transformer_engine")
    assert backend.kernels.transformer_engine and backend.kernels.wgrad_fusion and backend.kernels.rope_fusion
    batch = make_batch(1)
    # The backend computes logprobs only on loss-masked tokens (rlcore_megatron.output).
    diff = max_diff(on_mask(backend.logprobs(batch), batch), on_mask(hf_logprobs(path, batch), batch))
    backend.shutdown()
    print(f"{arch}: TE spec vs HF, fp32 logprobs, max |diff| {diff:.2e}")
    # TE's fp32 GEMMs round like TF32 (1.3e-3 seen for Llama on an H200, 2026-12-01) whatever torch's
    # flag says; a wrong weight layout gives differences of order 1.
    assert diff < 5e-3, diff


def test_te_spec_logprobs_bf16_and_te_attention(single_cuda_process_group, te_loads, tiny_model_factory):
    """bf16: mean |diff| within 0.02 and max within 0.15 (a bf16 logit carries ~3 significant
    digits; the two models round in different places). TE's cuDNN attention equals the flash path
    to the same tolerance."""
    path = str(tiny_model_factory("llama", hidden_size=256, num_heads=4, num_kv_heads=2))
    batch = make_batch(2)
    flash = cuda_backend(path, "bfloat16", transformer_impl="transformer_engine")
    ours = flash.logprobs(batch)
    flash.shutdown()
    te_attn = cuda_backend(path, "bfloat16", transformer_impl="transformer_engine", core_attention="transformer_engine")
    theirs = te_attn.logprobs(batch)
    te_attn.shutdown()
    ours, theirs, hf = (on_mask(lp, batch) for lp in (ours, theirs, hf_logprobs(path, batch, torch.bfloat16)))
    vs_hf, vs_attn = (max_diff(ours, hf), mean_diff(ours, hf)), (max_diff(ours, theirs), mean_diff(ours, theirs))
    print(f"llama bf16: TE spec vs HF |diff| max/mean {vs_hf}; flash vs TE attention {vs_attn}")
    assert vs_hf[0] < 0.15 and vs_hf[1] < 0.02 and vs_attn[0] < 0.15 and vs_attn[1] < 0.02, (vs_hf, vs_attn)


def test_gemm_sm_margin_sets_the_carveout_keeps_logprobs_and_is_restored(single_cuda_process_group, te_loads,
                                                                         tiny_model_factory):
    """The margin is process-wide (TE's env var, torch's BLAS library and carveout) while the backend
    lives; its shutdown restores what was there before."""
    import os

    from rlcore.config import ConfigError

    path = str(tiny_model_factory("llama", hidden_size=256, num_heads=4, num_kv_heads=2))
    batch = make_batch(2)
    plain = cuda_backend(path, "bfloat16", transformer_impl="transformer_engine")
    want = plain.logprobs(batch)
    plain.shutdown()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    before = (os.environ.get("NVTE_EXT_MARGIN_SM"), torch.backends.cuda.preferred_blas_library(),
              torch._C._get_sm_carveout_experimental())
    with pytest.raises(ConfigError, match=rf"policy\.megatron_cfg\.experimental\.gemm_sm_margin.*{sms} SMs"):
        cuda_backend(path, "bfloat16", transformer_impl="transformer_engine", experimental={"gemm_sm_margin": sms})
    margin = cuda_backend(path, "bfloat16", transformer_impl="transformer_engine", experimental={"gemm_sm_margin": 32})
    assert torch._C._get_sm_carveout_experimental() == 32 and os.environ["NVTE_EXT_MARGIN_SM"] == "32"
    assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    got = margin.logprobs(batch)
    margin.shutdown()
    after = (os.environ.get("NVTE_EXT_MARGIN_SM"), torch.backends.cuda.preferred_blas_library(),
             torch._C._get_sm_carveout_experimental())
    assert after == before
    got, want = on_mask(got, batch), on_mask(want, batch)
    print(f"gemm_sm_margin 32 of {sms} SMs vs every SM, bf16 logprobs |diff| max {max_diff(got, want):.2e} mean {mean_diff(got, want):.2e}")
    assert max_diff(got, want) < 0.15 and mean_diff(got, want) < 0.02


def exported(backend) -> dict[str, torch.Tensor]:
    return {n: t.float().cpu() for chunk in backend.export_weights() for n, t in chunk}


def exported_initial(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t.float() for f in sorted(Path(path).glob("*.safetensors")) for n, t in load_file(f).items()}


def test_te_training_step_equals_local_spec_fp32(single_cuda_process_group, te_loads, tiny_model_factory):
    """SGD, so the update is linear in the gradient and the weight difference measures the gradient's
    (AdamW's first step is ~lr * sign(g): TF32-like rounding flips the sign of near-zero gradients)."""
    path = str(tiny_model_factory("qwen3", hidden_size=256, num_heads=4, num_kv_heads=2))
    batch = make_batch(5, n=8)
    results = {}
    for impl in ("local", "transformer_engine"):
        # Megatron's distributed optimizer takes Adam only.
        backend = cuda_backend(path, transformer_impl=impl, optimizer={"optimizer": "sgd", "lr": 0.5, "sgd_momentum": 0.0,
                                                                     "use_distributed_optimizer": False})
        metrics = backend.train(batch, SumNLL())
        results[impl] = metrics, exported(backend)
        backend.shutdown()
    (m_local, w_local), (m_te, w_te) = results["local"], results["transformer_engine"]
    loss_diff = abs(m_local["loss"] - m_te["loss"])
    norm_diff = abs(m_local["grad_norm"] - m_te["grad_norm"]) / m_local["grad_norm"]
    weight_diff = max(float((w_local[k] - w_te[k]).abs().max()) for k in w_local)
    initial = exported_initial(path)
    moved = max(float((w_te[k] - initial[k]).abs().max()) for k in initial)
    print(f"TE vs local training step (fp32): loss {loss_diff:.2e}, grad norm {norm_diff:.2e} rel, weights {weight_diff:.2e} "
          f"(the step moved weights by up to {moved:.2e})")
    assert set(w_local) == set(w_te)
    # TF32-like GEMMs in TE (see above) leave ~1e-3 relative differences; a missing or doubled
    # weight gradient (the fused accumulation into main_grad) would differ by the whole update.
    assert loss_diff < 1e-3 and norm_diff < 5e-3 and weight_diff < 2e-2 * moved, (loss_diff, norm_diff, weight_diff, moved)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_trains_on_unaligned_packed_micro_batches(single_cuda_process_group, te_loads, tiny_model_factory, recipe):
    """Sequence lengths 5..23 (make_batch): the packer pads each micro-batch to the FP8 row multiple."""
    path = str(tiny_model_factory("llama", hidden_size=256, num_heads=4, num_kv_heads=2))
    batch = make_batch(3, n=8)
    bf16 = cuda_backend(path, "bfloat16", transformer_impl="transformer_engine")
    ref = bf16.logprobs(batch)
    bf16.shutdown()
    fp8 = cuda_backend(path, "bfloat16", fp8_cfg={"enabled": True, "fp8_recipe": recipe})
    assert fp8.kernels.token_multiple == 16  # without the padding TE refuses: "ret.lda % 16 == 0 ... Caller must pad"
    before = fp8.logprobs(batch)
    metrics = [fp8.train(batch, SumNLL()) for _ in range(3)]
    after = fp8.logprobs(batch)
    fp8.shutdown()
    gap = (max_diff(before, ref), mean_diff(before, ref))
    print(f"fp8 {recipe}: logprobs vs bf16 |diff| max/mean {gap}; losses {[round(m['loss'], 4) for m in metrics]}")
    assert all(torch.isfinite(torch.tensor(m["loss"])) and "skipped_nonfinite" not in m for m in metrics)
    assert gap[1] < 0.1, gap  # e4m3 keeps 3 mantissa bits: per-logit noise of a few percent
    assert max_diff(after, before) > 1e-3  # the steps changed the model


def test_te_op_fuser_mlp_equals_the_module_mlp(single_cuda_process_group, te_loads, tiny_model_factory):
    """``use_te_op_fuser``: the MLP runs as one TE op sequence over the same parameters (names, values)."""
    path = str(tiny_model_factory("llama", hidden_size=256, num_heads=4, num_kv_heads=2))
    batch = make_batch(4)
    plain = cuda_backend(path, transformer_impl="transformer_engine", use_te_op_fuser=False)
    want = plain.logprobs(batch)
    plain.shutdown()
    fused = cuda_backend(path, transformer_impl="transformer_engine", use_te_op_fuser=True)
    assert "te-op-fuser-mlp" in fused.kernels.describe()
    got = fused.logprobs(batch)
    metrics = fused.train(batch, SumNLL())
    after = fused.logprobs(batch)
    fused.shutdown()
    print(f"op fuser vs module MLP, fp32 logprobs max |diff| {max_diff(got, want):.2e}")
    assert max_diff(got, want) < 1e-4 and torch.isfinite(torch.tensor(metrics["loss"])) and max_diff(after, got) > 1e-4


def graph_backend(path: str, capture: bool, **mcfg):
    """The backend as ``benchmarks/bench_train_megatron.py`` builds its cuda-graph variants."""
    from rlcore.config import RunConfig, structure
    from rlcore.config.schema import PolicyConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.config import SECTION, MegatronConfig

    policy = PolicyConfig(model_name=path, precision="bfloat16",
                          sequence_packing=SequencePackingConfig(train_mb_tokens=64, logprob_mb_tokens=64))
    cfg = structure(MegatronConfig, {"enabled": True, "transformer_impl": "transformer_engine",
                                     "optimizer": {"optimizer": "sgd", "lr": 0.05, "sgd_momentum": 0.0, "clip_grad": 0.0,
                                                   "use_distributed_optimizer": False}, **mcfg}, SECTION)
    return MegatronBackend(RunConfig(policy=policy), cfg, WorldInfo(device="cuda"), cuda_graph_capture=capture)


@pytest.mark.parametrize("algo_name", ["sft", "grpo"])
def test_cuda_graph_steps_equal_the_eager_path(single_cuda_process_group, te_loads, tiny_model_factory, algo_name):
    """``cuda_graph: micro_batch``: three SGD steps on batches of other lengths (several micro-batches
    of at most 64 tokens each), captured once per bucket and replayed, against the same padded path
    run eagerly (``cuda_graph_capture=False``: the same kernels, so near-equal) and against Megatron's
    schedule (other GEMM row counts: bf16 rounding). Compared: every metric of every step (loss,
    grad_norm and the loss's own) and the last step's fp32 gradients in the main-grad buffers (a
    gradient missing from a replay, or added twice, is off by 100%)."""
    from cuda_graph_worker import algorithm, make_batch as grpo_batch, rel
    from rlcore.algorithms.sft import SFT

    path = str(tiny_model_factory("llama", hidden_size=256, num_heads=4, num_kv_heads=2))
    runs = {}
    for name, mode, capture in (("schedule", "none", True), ("eager", "micro_batch", False), ("graphs", "micro_batch", True)):
        backend = graph_backend(path, capture, cuda_graph=mode)
        algo = SFT() if algo_name == "sft" else algorithm()
        metrics = [backend.train(grpo_batch(seed, n=10), algo) for seed in (11, 12, 13)]
        # the last step's fp32 gradients stay in the main-grad buffers until the next step zeroes them
        grads = {n: p.main_grad.detach().float().clone() for n, p in backend.module.named_parameters()}
        graphs = backend.graphs
        stats = None if graphs is None else (len(graphs.graphs), graphs.replays, max(len(v) for v in graphs.lengths_seen.values()))
        runs[name] = metrics, grads, stats
        backend.shutdown()

    def diffs(a, b):
        (m_a, d_a, _), (m_b, d_b, _) = runs[a], runs[b]
        keys = sorted(set(m_a[0]) - {"train_seconds"})
        assert keys == sorted(set(m_b[0]) - {"train_seconds"})
        metric = max(float(rel(torch.tensor(x[k]), torch.tensor(y[k]))) for x, y in zip(m_a, m_b) for k in keys)
        grad = max(float((d_a[k] - d_b[k]).norm() / d_a[k].norm().clamp(min=1e-12)) for k in d_a)
        return metric, grad

    captured, replays, lengths = runs["graphs"][2]
    near, far = diffs("eager", "graphs"), diffs("schedule", "graphs")
    print(f"cuda graphs ({algo_name}): {captured} captured, {replays} replays, up to {lengths} lengths in one bucket; "
          f"vs eager padded path: metrics {near[0]:.2e}, last step's gradients {near[1]:.2e} rel; "
          f"vs schedule: metrics {far[0]:.2e}, gradients {far[1]:.2e} rel")
    assert captured >= 1 and replays >= 3 and lengths >= 2  # replays over micro-batches of different lengths
    assert near[0] < 1e-3 and near[1] < 1e-2, near
    assert far[0] < 0.02 and far[1] < 0.05, far  # GEMMs over other row counts round differently

