"""The engine's work on a high-priority stream of its own (``rollout_stream_priority: high``), with a
trainer's kernels running on the default stream of the same process. CUDA only; skipped elsewhere.

What could go wrong, and is checked: scores under contention must equal scores without it (the
engine's kernels are ordered on its own stream), and a refit whose chunks the caller has just
queued on the default stream must load their final values (the engine's stream waits for the
caller's before reading them); a missing wait reads the chunks before they are written.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a CUDA device")


def _hf_logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    ids = torch.tensor(sequences, device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    picked = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return [[0.0] + row for row in picked.tolist()]


def _mean_gap(a: list[list[float]], b: list[list[float]]) -> float:
    gaps = [abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a[1:], row_b[1:])]
    return sum(gaps) / len(gaps)


def test_high_priority_engine_stream_under_a_busy_default_stream(tiny_model_factory, monkeypatch):
    from transformers import AutoModelForCausalLM

    from _vllm_helpers import perturbed_state_dict
    from rlcore.weights import chunked
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import VllmGenerator

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    path = str(tiny_model_factory("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    new_state = perturbed_state_dict(model, scale=0.05)
    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(3, model.config.vocab_size, (4, 48), generator=g).tolist()

    cfg = VllmConfig(enforce_eager=True, gpu_memory_utilization=0.15, gpu_kv_cache_gib=1.0, max_num_seqs=16,
                     enable_prefix_caching=False)
    engine = VllmGenerator(path, cfg, max_model_len=256, dtype="bfloat16", seed=0, device="cuda", high_priority_stream=True)
    assert engine._stream is not None and engine._stream.priority < 0
    quiet = engine.score(sequences)

    busy = torch.randn(4096, 4096, device="cuda")
    stop = threading.Event()

    def trainer():  # kernels on the default stream, as a trainer in this process would launch
        while not stop.is_set():
            for _ in range(8):
                busy @ busy

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        contended = engine.score(sequences)
    finally:
        stop.set()
        thread.join()
    worst = max(abs(x - y) for row_a, row_b in zip(contended, quiet) for x, y in zip(row_a, row_b))
    assert worst < 1e-5, worst  # the same kernels on the same inputs

    # Chunks queued behind a long default-stream computation, handed over at once.
    for _ in range(30):
        busy = busy @ busy / 4096**0.5
    chunks = [(name, t.to("cuda") * 1.0) for name, t in new_state.items()]
    engine.update_weights(chunked(iter(chunks), 1 << 20))
    refit = engine.score(sequences)
    engine.shutdown()

    model.load_state_dict(new_state)
    expected = _hf_logprobs(model.to("cuda"), sequences)
    same, moved = _mean_gap(refit, expected), _mean_gap(quiet, expected)
    print(f"high-priority engine stream: refit vs Hugging Face {same:.2e}; before the refit {moved:.2e}")
    assert same < 0.03 and moved > 5 * same, (same, moved)  # bf16 engine against the fp32 model
