"""The models the benchmarks build (``rlcore bench``, ``benchmarks/bench_grpo_step.py``), as widths and as the
planner's :class:`~rlcore.planning.shapes.ModelShape`: one description that builds the model and that the planner's
fit (:mod:`rlcore.planning.fit`) and held-out test read a benchmark row's model from. Llamas with an output layer of
their own (transformers' default ``tie_word_embeddings=False``)."""

from __future__ import annotations

from rlcore.planning.shapes import ModelShape, from_hf_config

# Llama-family shapes (head_dim 64 or 128); "demo" is the CPU demo's 2.4M-parameter Llama.
SHAPES = {
    "demo": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688, vocab_size=128,
                 max_positions=128),
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256, vocab_size=128,
                 max_positions=512),
    "llama1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                    vocab_size=128256, max_positions=20480),
    # Qwen2.5-0.5B's widths (GQA 14/2, a 152k vocabulary) in a Llama: a shape no calibration read
    "llama0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                      vocab_size=151936, max_positions=20480),
    "llama3b": dict(hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, intermediate_size=8192,
                    vocab_size=128256, max_positions=20480),
    "llama8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                    vocab_size=128256, max_positions=20480),
}


def bench_shape(name: str) -> ModelShape:
    """The planner's shape of the benchmark model ``name`` (a key of :data:`SHAPES`)."""
    s = SHAPES[name]
    return from_hf_config(name, {"model_type": "llama", "hidden_size": s["hidden_size"], "num_hidden_layers": s["num_layers"],
                                 "num_attention_heads": s["num_heads"], "num_key_value_heads": s["num_kv_heads"],
                                 "intermediate_size": s["intermediate_size"], "vocab_size": s["vocab_size"],
                                 "tie_word_embeddings": False})
