"""Attention over packed sequences, registered with transformers as ``rlcore_varlen``.

A packed micro-batch is one row ``[1, T]`` holding several sequences back to back
(``cu_seqlens`` boundaries, trailing padding). Each token may only attend to earlier tokens of
its own sequence. The model is called with ``cu_seq_lens_q`` / ``max_length_q`` keyword
arguments (transformers forwards them to the attention function untouched) and:

- on CUDA in bf16/fp16, :func:`torch.nn.attention.varlen.varlen_attn` runs FlashAttention's
  varlen kernel over the whole row (no mask is ever materialized);
- otherwise (CPU, fp32/fp64) causal :func:`~torch.nn.functional.scaled_dot_product_attention`
  runs per sequence: one call over a padded ``[n, H, max_len, D]`` batch when the sequences
  have similar lengths (padding costs at most 2x the exact work), else one call per sequence.
  Either is exact and needs far less than a ``T x T`` block-diagonal mask.

Trailing padding is attended as a sequence of its own: its outputs are finite (never read), so
``0 * garbage`` cannot turn into NaN in the backward matmuls.

transformers builds no mask for an attention implementation it has no mask function for, so
registering only the attention function keeps ``create_causal_mask`` a no-op.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "rlcore_varlen"


def attention_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int, device: torch.device | str) -> tuple[torch.Tensor, int]:
    """Boundaries covering every token: the real sequences, then the padding as one more segment."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.int32)
    if int(cu[-1]) < total_tokens:
        cu = torch.cat([cu, torch.tensor([total_tokens], dtype=torch.int32)])
    max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return cu.to(device), max_len


@functools.lru_cache(maxsize=1)
def _varlen_kwargs() -> dict | None:
    """Causal/GQA keyword arguments of this torch's ``varlen_attn`` (its signature changed in 2.11)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def _use_varlen(query: torch.Tensor, dropout: float) -> bool:
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0
            and _varlen_kwargs() is not None)


@torch.compiler.disable  # one kernel (or a host loop on CPU): keep it out of compiled layers' graphs
def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query`` [B, H, T, D], ``key``/``value`` [B, Hkv, T, D]
    -> ([B, T, H, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    batch, _, tokens, _ = query.shape
    if cu is None or batch != 1:
        # Plain (unpacked) call, e.g. generation or a caller that did not pack: causal per row.
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if _use_varlen(query, dropout):
        from torch.nn.attention.varlen import varlen_attn

        max_len = int(kwargs.get("max_length_q") or tokens)
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, H, D]
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, **_varlen_kwargs())
        return out.unsqueeze(0), None
    bounds = cu.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout, is_causal=True, scale=scaling,
                             enable_gqa=key.shape[1] != query.shape[1])
    if len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= 2 * sum(n * n for n in lengths):
        out = _padded_rows(sdpa, query, key, value, bounds, lengths)
    else:
        pieces = [sdpa(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        out = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
    return out.transpose(1, 2).contiguous(), None


def _padded_rows(sdpa, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                 lengths: list[int]) -> torch.Tensor:
    """Similar-length sequences as one causal SDPA over a [n, H, max_len, D] batch.

    Row i reads tokens ``start_i .. start_i + max_len`` (clamped): its real queries only see keys
    at or before their own position, all inside sequence i, so whatever fills the tail is never
    attended by a kept output, and the tail's outputs are dropped."""
    tokens, max_len = query.shape[2], max(lengths)
    starts = torch.tensor([a for a, b in zip(bounds[:-1], bounds[1:]) if b > a], device=query.device)
    offsets = torch.arange(max_len, device=query.device)
    index_NL = (starts[:, None] + offsets[None, :]).clamp(max=tokens - 1)
    keep_NL = offsets[None, :] < torch.tensor(lengths, device=query.device)[:, None]
    rows = [x[0][:, index_NL].transpose(0, 1) for x in (query, key, value)]  # [n, H, max_len, D]
    out_NHLD = sdpa(*rows)
    return out_NHLD.transpose(0, 1)[:, keep_NL].unsqueeze(0)  # [1, H, T, D], packed order


def register() -> str:
    """Register ``rlcore_varlen`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)
    return ATTN_IMPLEMENTATION
