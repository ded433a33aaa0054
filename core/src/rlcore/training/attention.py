"""Causal attention over packed sequences, shared by the training backends.

A packed micro-batch is one stream of ``T`` tokens holding several sequences back to back
(``cu_seqlens`` boundaries). Each token may only attend to earlier tokens of its own sequence.
:func:`packed_causal_attention` takes the thd layout (query ``[T, H, D]``, key/value
``[T, G, D]`` with ``H % G == 0``) and:

- on CUDA in bf16/fp16, runs FlashAttention's varlen kernel
  (:func:`torch.nn.attention.varlen.varlen_attn`) over the whole stream: one kernel, no mask, no
  host loop;
- otherwise (CPU, fp32/fp64) runs causal :func:`~torch.nn.functional.scaled_dot_product_attention`
  per sequence: one call over a padded ``[n, H, max_len, D]`` batch when the sequences have
  similar lengths (padding costs at most 2x the exact work), else one call per sequence. Either
  is exact and needs far less than a ``T x T`` block-diagonal mask.

Every SDPA call here avoids the cuDNN backend on CUDA (:func:`sdpa`): cuDNN builds an execution
plan for each new sequence length, which costs milliseconds of host time per call and stalls the
GPU for tens of milliseconds per new shape (the Megatron backend fell to 5% MFU with random
lengths). RL batches have a new set of lengths at every step.

Written here rather than taken from a library because the library kernels (flash-attn,
Transformer Engine) are not installable on every machine rlcore targets; torch's own varlen
kernel is, and this module only chooses between torch's kernels.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F


def attention_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int, device: torch.device | str) -> tuple[torch.Tensor, int]:
    """Boundaries covering every token (int32 on ``device``) and the longest segment.

    Trailing padding becomes one more segment: it attends to itself only, so its outputs are
    finite (never read) and ``0 * garbage`` cannot turn into NaN in the backward matmuls.
    """
    cu = cu_seqlens.to(device="cpu", dtype=torch.int32)
    if int(cu[-1]) < total_tokens:
        cu = torch.cat([cu, torch.tensor([total_tokens], dtype=torch.int32)])
    max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return cu.to(device, non_blocking=True), max_len  # no stream sync: the host runs ahead of the GPU


def _load_varlen() -> tuple:
    """torch's ``varlen_attn`` and its causal/GQA keyword arguments (the signature changed in 2.11),
    or (None, None). Looked up once at import, so the traced CUDA path below holds no lookups."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return varlen_attn, kwargs


_VARLEN_ATTN, _VARLEN_KWARGS = _load_varlen()


def use_varlen(query: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether :func:`packed_causal_attention` takes the FlashAttention varlen kernel for ``query``."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0
            and _VARLEN_ATTN is not None)


@functools.lru_cache(maxsize=1)
def _non_cudnn_backends() -> list:
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """:func:`torch.nn.functional.scaled_dot_product_attention` without the cuDNN backend on CUDA
    (see the module docstring); ``enable_gqa`` is set when key/value have fewer heads."""
    kwargs.setdefault("enable_gqa", key.shape[-3] != query.shape[-3])
    guard = contextlib.nullcontext()
    if query.is_cuda:
        from torch.nn.attention import sdpa_kernel

        guard = sdpa_kernel(_non_cudnn_backends())
    with guard:
        return F.scaled_dot_product_attention(query, key, value, **kwargs)


def packed_causal_attention(query_THD: torch.Tensor, key_TGD: torch.Tensor, value_TGD: torch.Tensor,
                            cu_seqlens: torch.Tensor, max_len: int, *, scale: float | None = None,
                            dropout: float = 0.0, cu_seqlens_k: torch.Tensor | None = None,
                            max_len_k: int | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence -> ``[T, H, D]``.

    ``cu_seqlens``: int32 boundaries covering all ``T`` tokens (:func:`attention_cu_seqlens`), on
    the tensors' device for the varlen kernel; ``max_len``: the longest segment.

    With ``cu_seqlens_k`` (and ``max_len_k``), segment i's queries attend to key segment i, which
    may be longer (context parallelism: a query chunk and every key before it). The causal mask is
    then aligned to the bottom right, FlashAttention's convention: query j of a segment with
    ``Lq`` queries and ``Lk`` keys sees keys ``0 .. Lk - Lq + j``.

    The varlen path is one custom op that ``torch.compile`` traces (a compiled decoder layer stays
    one graph); the exact path loops on the host and is kept out of compiled graphs.
    """
    if use_varlen(query_THD, dropout):
        # With longer key segments FlashAttention aligns the causal mask to the bottom right (also
        # torch's note in torch.nn.attention.bias.CausalBias).
        cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
        max_k = max_len if max_len_k is None else max_len_k
        q, k, v = (x.contiguous() for x in (query_THD, key_TGD, value_TGD))
        return _VARLEN_ATTN(q, k, v, cu_seqlens, cu_k, max_len, max_k, scale=scale, **_VARLEN_KWARGS)
    return _exact_causal_attention(query_THD, key_TGD, value_TGD, cu_seqlens, scale=scale, dropout=dropout,
                                   cu_seqlens_k=cu_seqlens_k)


@torch.compiler.disable  # a host loop over sequences: keep it out of compiled graphs
def _exact_causal_attention(query_THD: torch.Tensor, key_TGD: torch.Tensor, value_TGD: torch.Tensor,
                            cu_seqlens: torch.Tensor, *, scale: float | None, dropout: float,
                            cu_seqlens_k: torch.Tensor | None) -> torch.Tensor:
    """:func:`packed_causal_attention` off the varlen kernel: exact SDPA per sequence."""
    if cu_seqlens_k is not None:
        return _causal_attention_lower_right(query_THD, key_TGD, value_TGD, cu_seqlens, cu_seqlens_k, scale=scale,
                                             dropout=dropout)
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    run = functools.partial(sdpa, dropout_p=dropout, is_causal=True, scale=scale)
    q, k, v = (x.transpose(0, 1)[None] for x in (query_THD, key_TGD, value_TGD))  # [1, H, T, D]
    if len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= 2 * sum(n * n for n in lengths):
        out_1HTD = padded_rows_attention(run, q, k, v, bounds, lengths)
    else:
        pieces = [run(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        out_1HTD = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
    return out_1HTD[0].transpose(0, 1)


def padded_rows_attention(run, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
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
    out_NHLD = run(*rows)
    return out_NHLD.transpose(0, 1)[:, keep_NL].unsqueeze(0)  # [1, H, T, D], packed order


def _causal_attention_lower_right(query_THD, key_TGD, value_TGD, cu_q, cu_k, *, scale: float | None,
                                  dropout: float) -> torch.Tensor:
    """Segment i's queries over key segment i, causal mask aligned to the bottom right (exact SDPA
    per segment, off the varlen kernel)."""
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    q, k, v = (x.transpose(0, 1)[None] for x in (query_THD, key_TGD, value_TGD))  # [1, H, T, D]
    pieces = []
    for qa, qb, ka, kb in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:]):
        if qb == qa:
            continue
        if kb - ka < qb - qa:
            raise ValueError(f"packed_causal_attention: a segment has {qb - qa} queries but only {kb - ka} keys")
        mask = torch.ones(qb - qa, kb - ka, dtype=torch.bool, device=query_THD.device).tril(diagonal=(kb - ka) - (qb - qa))
        pieces.append(sdpa(q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], attn_mask=mask, dropout_p=dropout, scale=scale))
    out_1HTD = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
    return out_1HTD[0].transpose(0, 1)
