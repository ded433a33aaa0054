"""Tensor ops shared by backends and losses.

:func:`token_logprobs` turns a micro-batch's logits into token-aligned logprobs without ever
materializing full-vocabulary float32 log-softmax for the whole micro-batch: a custom autograd
function keeps only the (model-dtype) logits and one logsumexp per token, and recomputes the
softmax chunk by chunk in the backward pass. With a 150k vocabulary and 16k tokens that is the
difference between ~10 GB of float32 activations and a few MB.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32 at least; float64 logits (invariance tests) stay float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _ChunkedTargetLogprob(torch.autograd.Function):
    """out[r] = log_softmax(logits[r] / temperature)[targets[r]], computed ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, logits_RV: torch.Tensor, targets_R: torch.Tensor, chunk: int, temperature: float):
        acc = _acc_dtype(logits_RV.dtype)
        out_R = torch.empty(logits_RV.shape[0], dtype=acc, device=logits_RV.device)
        lse_R = torch.empty_like(out_R)
        for a in range(0, logits_RV.shape[0], chunk):
            x = logits_RV[a : a + chunk].to(acc) / temperature
            lse_R[a : a + chunk] = torch.logsumexp(x, dim=-1)
            out_R[a : a + chunk] = x.gather(1, targets_R[a : a + chunk, None]).squeeze(1) - lse_R[a : a + chunk]
        ctx.save_for_backward(logits_RV, targets_R, lse_R)
        ctx.chunk, ctx.temperature = chunk, temperature
        return out_R

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_R: torch.Tensor):
        logits_RV, targets_R, lse_R = ctx.saved_tensors
        acc = lse_R.dtype
        grad_RV = torch.empty_like(logits_RV)
        for a in range(0, logits_RV.shape[0], ctx.chunk):
            x = logits_RV[a : a + ctx.chunk].to(acc) / ctx.temperature
            g = grad_R[a : a + ctx.chunk, None].to(acc)
            # d/dx [x_t - lse(x)] = onehot(t) - softmax(x)
            dx = torch.exp(x - lse_R[a : a + ctx.chunk, None]).mul_(-g)
            dx.scatter_add_(1, targets_R[a : a + ctx.chunk, None], g)
            grad_RV[a : a + ctx.chunk] = (dx / ctx.temperature).to(logits_RV.dtype)
        return grad_RV, None, None, None


def token_logprobs(logits_TV: torch.Tensor, input_ids_T: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                   *, chunk_tokens: int = 1024, temperature: float = 1.0) -> torch.Tensor:
    """Token-aligned logprobs [T]: ``out[t] = log_softmax(logits[t-1] / temperature)[ids[t]]``.

    ``out`` is 0 at the first token of each sequence (``cu_seqlens`` boundaries; None = one
    sequence) and on trailing padding after ``cu_seqlens[-1]``. float32 (float64 for float64
    logits); differentiable with respect to ``logits_TV``.
    """
    if logits_TV.dim() != 2:
        raise ValueError(f"token_logprobs: logits must be [T, V], got shape {tuple(logits_TV.shape)}")
    T = logits_TV.shape[0]
    if input_ids_T.shape != (T,):
        raise ValueError(f"token_logprobs: input_ids has shape {tuple(input_ids_T.shape)}, logits have {T} rows")
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"token_logprobs: chunk_tokens must be >= 1, got {chunk_tokens}")
    acc = _acc_dtype(logits_TV.dtype)
    if T == 0:
        return logits_TV.sum(-1).to(acc)
    shifted = _ChunkedTargetLogprob.apply(logits_TV[:-1], input_ids_T[1:].long(), chunk_tokens, float(temperature))
    out_T = torch.cat([shifted.new_zeros(1), shifted])
    if cu_seqlens is None:
        return out_T
    keep_T = torch.zeros(T, dtype=torch.bool, device=logits_TV.device)
    keep_T[: int(cu_seqlens[-1])] = True
    keep_T[cu_seqlens[:-1].long().to(logits_TV.device)] = False
    return torch.where(keep_T, out_T, torch.zeros((), dtype=acc, device=out_T.device))
