"""FP8 rollouts (``policy.generation.quantization: fp8``): a refit of bf16 weights into an FP8
engine re-quantizes them. CUDA only (vLLM's FP8 kernels); skipped elsewhere.

The check that matters: after a refit, the FP8 engine scores sequences as an FP8 engine started
from the new weights does, and not as it did before; a refit that wrote bf16 values into FP8
storage, or skipped the re-quantization, gives gaps of order 1 (or garbage).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's FP8 kernels need a CUDA device")

# This process has asked CUDA about devices; an engine process it forks could not use CUDA.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def _engine(path: str):
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import VllmGenerator

    cfg = VllmConfig(quantization="fp8", enforce_eager=True, gpu_memory_utilization=0.15, gpu_kv_cache_gib=1.0,
                     max_num_seqs=16, enable_prefix_caching=False)
    return VllmGenerator(path, cfg, max_model_len=256, dtype="bfloat16", seed=0, device="cuda")


def _mean_gap(a: list[list[float]], b: list[list[float]]) -> float:
    gaps = [abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a[1:], row_b[1:])]
    return sum(gaps) / len(gaps)


def test_refit_into_an_fp8_engine_equals_an_engine_started_from_the_new_weights(tiny_model_factory, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    from _vllm_helpers import perturbed_state_dict
    from rlcore.training.weights import chunked

    old_path = str(tiny_model_factory("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2))
    model = AutoModelForCausalLM.from_pretrained(old_path, torch_dtype=torch.float32)
    new_state = perturbed_state_dict(model, scale=0.05)
    model.load_state_dict(new_state)
    new_path = str(tmp_path / "new")
    shutil.copytree(old_path, new_path)  # tokenizer and configs; the weights are overwritten below
    model.to(torch.bfloat16).save_pretrained(new_path)

    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(3, model.config.vocab_size, (4, 48), generator=g).tolist()

    engine = _engine(old_path)
    before = engine.score(sequences)
    engine.update_weights(chunked(((n, t.to("cuda", torch.bfloat16)) for n, t in new_state.items()), 1 << 20))
    refit = engine.score(sequences)
    engine.shutdown()

    fresh = _engine(new_path)
    started = fresh.score(sequences)
    fresh.shutdown()

    same, moved = _mean_gap(refit, started), _mean_gap(before, started)
    print(f"fp8 engine: refit vs started from the new weights {same:.2e}; before vs after the refit {moved:.2e}")
    assert same < 0.02 and moved > 10 * same, (same, moved)
