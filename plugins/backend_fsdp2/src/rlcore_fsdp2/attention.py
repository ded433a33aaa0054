"""Attention over packed sequences, registered with transformers as ``rlcore_varlen``.

A packed micro-batch is one row ``[1, T]`` holding several sequences back to back
(``cu_seqlens`` boundaries, trailing padding as one more segment). The model is called with
``cu_seq_lens_q`` / ``max_length_q`` keyword arguments (transformers forwards them to the
attention function untouched) and :func:`rlcore.training.attention.packed_causal_attention` does the
work: FlashAttention's varlen kernel on CUDA in bf16/fp16, exact per-sequence SDPA otherwise.

transformers builds no mask for an attention implementation it has no mask function for, so
registering only the attention function keeps ``create_causal_mask`` a no-op.
"""

from __future__ import annotations

import torch

from rlcore.training.attention import attention_cu_seqlens, packed_causal_attention, sdpa

__all__ = ["ATTN_IMPLEMENTATION", "attention_cu_seqlens", "register", "varlen_attention_forward"]

ATTN_IMPLEMENTATION = "rlcore_varlen"


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query`` [B, H, T, D], ``key``/``value`` [B, Hkv, T, D]
    -> ([B, T, H, D], None). Traceable by ``torch.compile`` on the CUDA varlen path."""
    cu = kwargs.get("cu_seq_lens_q")
    batch, _, tokens, _ = query.shape
    if cu is None or batch != 1:
        return _causal_rows(query, key, value, dropout, scaling), None
    max_len = int(kwargs.get("max_length_q") or tokens)
    # squeeze, not [0]: a view, whose backward is free (indexing's backward fills a zero tensor)
    q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    out_THD = packed_causal_attention(q, k, v, cu, max_len, scale=scaling, dropout=dropout)
    return out_THD.unsqueeze(0), None


@torch.compiler.disable  # the cuDNN-free SDPA guard is a context manager; rare in compiled training anyway
def _causal_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float,
                 scaling: float | None) -> torch.Tensor:
    """Plain (unpacked) call, e.g. generation or a caller that did not pack: causal per row."""
    out = sdpa(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous()


def register() -> str:
    """Register ``rlcore_varlen`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)
    return ATTN_IMPLEMENTATION
