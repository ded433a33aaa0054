"""The mixture-of-experts shape the benchmarks measure: Qwen3-30B-A3B's layer at a depth one H200 trains.

Qwen3-30B-A3B's layer: hidden 2048, 32 query / 4 key-value heads of head_dim 128 (q/k RMSNorm),
128 experts of FFN 768, top-8 with renormalized softmax probabilities, vocabulary 151936, untied
embeddings. Its 48 layers (30.5B parameters) do not fit AdamW training on one GPU; at 8 layers:

    per layer   attention 18.87M + router 0.26M + experts 128 x 4.72M = 604.0M  -> 623.1M (active: 56.9M)
    embeddings  2 x 151936 x 2048 = 622.3M (input table + LM head)
    total       8 x 623.1M + 622.3M = 5.61B parameters; active per token 0.455B + 0.311B (LM head) = 0.77B matmul

Megatron's distributed optimizer on one GPU holds 18 bytes per parameter (bf16 weights 2, fp32
main gradients 4, fp32 main weights 4, Adam moments 8): 5.61B x 18 B = 94 GiB, leaving ~45 GiB of
the H200's 139 for activations (packed 8192-token micro-batches, top-8 dispatch: ~1 GiB per layer)
and the bf16 logits. 10 layers would need 115 GiB of state: too tight. ``--layers`` changes it.

MFU is counted on active parameters: ``6 * N_active_matmul * T + 6 * L * d_attn * sum len^2``
(the router's GEMM and the 8 chosen experts per token; the input embedding is a lookup, not a GEMM).
"""

from __future__ import annotations

DEFAULT_LAYERS = 8


def qwen3moe_config(num_layers: int = DEFAULT_LAYERS, *, tiny: bool = False):
    """transformers ``Qwen3MoeConfig`` of the benchmark shape (``tiny``: the same structure at CPU size)."""
    from transformers import Qwen3MoeConfig

    if tiny:
        return Qwen3MoeConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=True, decoder_sparse_step=1, vocab_size=512, max_position_embeddings=4096,
                              tie_word_embeddings=False)
    return Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=num_layers, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _attention(cfg) -> int:
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return h * q + 2 * h * kv + q * h


def params(cfg) -> tuple[int, int]:
    """(total parameters, active matmul parameters per token) of a Qwen3-MoE config."""
    h, expert = cfg.hidden_size, 3 * cfg.hidden_size * cfg.moe_intermediate_size
    router = h * cfg.num_experts
    norms = 2 * h + 2 * cfg.head_dim
    total = cfg.num_hidden_layers * (_attention(cfg) + router + cfg.num_experts * expert + norms) + 2 * cfg.vocab_size * h + h
    active = cfg.num_hidden_layers * (_attention(cfg) + router + cfg.num_experts_per_tok * expert) + cfg.vocab_size * h
    return total, active


def step_flops(cfg, lengths: list[int]) -> float:
    """Training FLOPs of one step over sequences of ``lengths`` (forward + backward, active parameters)."""
    d_attn = cfg.num_attention_heads * cfg.head_dim
    return 6.0 * params(cfg)[1] * sum(lengths) + 6.0 * cfg.num_hidden_layers * d_attn * sum(n * n for n in lengths)


def adamw_state_gib(cfg) -> float:
    """Megatron distributed-optimizer state on one GPU (18 bytes a parameter), GiB."""
    return params(cfg)[0] * 18 / 2**30


if __name__ == "__main__":
    for layers in (8, 10, 48):
        c = qwen3moe_config(layers)
        total, active = params(c)
        print(f"{layers} layers: {total / 1e9:.2f}B total, {active / 1e9:.3f}B active matmul, "
              f"AdamW state {adamw_state_gib(c):.0f} GiB")
