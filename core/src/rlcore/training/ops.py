"""Tensor ops shared by backends and losses.

:func:`token_logprobs` turns a micro-batch's logits into token-aligned logprobs without ever
materializing full-vocabulary float32 log-softmax for the whole micro-batch: a custom autograd
function keeps only the (model-dtype) logits and one logsumexp per token, and recomputes the
softmax chunk by chunk in the backward pass. With a 150k vocabulary and 16k tokens that is the
difference between ~10 GB of float32 activations and a few MB.

:func:`vocab_parallel_token_logprobs` is the same computation when each tensor-parallel rank holds
a slice of the vocabulary (the Megatron backend): the per-token logsumexps and target logits
are combined across the group, so the full-vocabulary logits are never gathered. Each has a form
taking the logits of some rows only (:func:`selected_token_logprobs`,
:func:`vocab_parallel_selected_token_logprobs`): the rows whose logprobs a loss reads.

Each chunk's math is a few element-wise passes over ``[chunk, vocab]``. Run op by op, those passes
cost more GPU time than the LM head's matmuls (1.2B Llama shape, vocab 128256: about a tenth of
the eager training step).
On CUDA the two chunk functions are therefore compiled with ``torch.compile`` (the fused
kernels read the model-dtype logits once or twice and write the gradient once); elsewhere, or if
compiling fails, they run eagerly.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rlcore.training.compiling import CompiledOrEager


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32 at least; float64 logits (invariance tests) stay float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_forward(x_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(x / temperature)[targets], logsumexp(x / temperature)), both [C] in float32+."""
    x = x_CV.to(_acc_dtype(x_CV.dtype)) / temperature
    lse_C = torch.logsumexp(x, dim=-1)
    return x.gather(1, targets_C[:, None]).squeeze(1) - lse_C, lse_C


def _chunk_backward_fused(x_CV: torch.Tensor, targets_C: torch.Tensor, lse_C: torch.Tensor, grad_C: torch.Tensor,
                          temperature: float, out_CV: torch.Tensor) -> None:
    """d out / d x for :func:`_chunk_forward`: ``(onehot(t) - softmax(x / T)) * grad / T``, written
    into ``out_CV`` (x's dtype). ``lse_C`` may be the logsumexp over a larger vocabulary than x's
    columns (a vocabulary shard), and a target of -1 has no one-hot term (it lies in another shard).

    The one-hot as a comparison with an iota fuses into the same kernel when compiled, and so does
    the write into ``out_CV`` (a slice of the whole gradient: no second pass to copy it there)."""
    x = x_CV.to(lse_C.dtype) / temperature
    onehot_CV = torch.arange(x_CV.shape[1], device=x_CV.device)[None, :] == targets_C[:, None]
    dx = (onehot_CV.to(x.dtype) - torch.exp(x - lse_C[:, None])) * (grad_C[:, None] / temperature)
    out_CV.copy_(dx)


def _chunk_backward_eager(x_CV: torch.Tensor, targets_C: torch.Tensor, lse_C: torch.Tensor, grad_C: torch.Tensor,
                          temperature: float, out_CV: torch.Tensor) -> None:
    """Same as :func:`_chunk_backward_fused` with in-place ops and a scatter (no [C, V] one-hot)."""
    x = x_CV.to(lse_C.dtype, copy=True)  # a copy: the in-place ops below must not touch the saved logits
    if temperature != 1.0:
        x = x.div_(temperature)
    g = grad_C[:, None].to(lse_C.dtype) / temperature
    dx = x.sub_(lse_C[:, None]).exp_().mul_(-g)
    # A target of -1 lies in another rank's vocabulary shard (vocab_parallel_token_logprobs): no one-hot term here.
    owned = targets_C[:, None] >= 0
    dx.scatter_add_(1, targets_C[:, None].clamp_min(0), g * owned)
    out_CV.copy_(dx)


_KERNELS = CompiledOrEager("token_logprobs chunk kernels", {
    "forward": (_chunk_forward, _chunk_forward),
    "backward": (_chunk_backward_fused, _chunk_backward_eager),
})


def _run_chunk(name: str, fused: bool, *args):
    """The forward or backward chunk function, compiled when ``fused`` (eager after a failure).

    Only the chunk's row count varies (the last chunk of a row set, and micro-batches of other
    lengths): it is marked dynamic, the vocabulary stays a compile-time constant. With a symbolic
    vocabulary (``dynamic=True``) forward + backward moved 0.87 TB/s, with a constant one
    2.2 TB/s (H200, vocab 128256, ``benchmarks/bench_logprobs.py``)."""
    if fused:
        for arg in args:
            if torch.is_tensor(arg):
                torch._dynamo.maybe_mark_dynamic(arg, 0)
    return _KERNELS.run(name, fused, *args)


class _ChunkedTargetLogprob(torch.autograd.Function):
    """out[r] = log_softmax(logits[r] / temperature)[targets[r]], computed ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, logits_RV: torch.Tensor, targets_R: torch.Tensor, chunk: int, temperature: float, fused: bool):
        acc = _acc_dtype(logits_RV.dtype)
        out_R = torch.empty(logits_RV.shape[0], dtype=acc, device=logits_RV.device)
        lse_R = torch.empty_like(out_R)
        for a in range(0, logits_RV.shape[0], chunk):
            out_R[a : a + chunk], lse_R[a : a + chunk] = _run_chunk(
                "forward", fused, logits_RV[a : a + chunk], targets_R[a : a + chunk], temperature)
        ctx.save_for_backward(logits_RV, targets_R, lse_R)
        ctx.chunk, ctx.temperature, ctx.fused = chunk, temperature, fused
        return out_R

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_R: torch.Tensor):
        logits_RV, targets_R, lse_R = ctx.saved_tensors
        grad_RV = torch.empty_like(logits_RV)
        grad_R = grad_R.to(lse_R.dtype)
        for a in range(0, logits_RV.shape[0], ctx.chunk):
            rows = slice(a, a + ctx.chunk)
            _run_chunk("backward", ctx.fused, logits_RV[rows], targets_R[rows], lse_R[rows], grad_R[rows],
                       ctx.temperature, grad_RV[rows])
        return grad_RV, None, None, None, None


class _ChunkedVocabParallelLogprob(torch.autograd.Function):
    """As :class:`_ChunkedTargetLogprob` over a vocabulary split across ``group``: this rank holds
    columns ``[vocab_start, vocab_start + V_local)``. Two collectives per call: the per-row
    logsumexps are all-gathered and combined, the target logit (held by one rank) is all-reduced.
    The backward needs none: each rank's gradient is its own columns of ``onehot - softmax``."""

    @staticmethod
    def forward(ctx, logits_RV: torch.Tensor, targets_R: torch.Tensor, vocab_start: int, group, chunk: int,
                temperature: float, fused: bool):
        import torch.distributed as dist

        acc = _acc_dtype(logits_RV.dtype)
        local_R = targets_R - vocab_start
        owned_R = (local_R >= 0) & (local_R < logits_RV.shape[1])
        local_R = torch.where(owned_R, local_R, torch.full_like(local_R, -1))
        target_R = torch.empty(logits_RV.shape[0], dtype=acc, device=logits_RV.device)
        lse_R = torch.empty_like(target_R)
        for a in range(0, logits_RV.shape[0], chunk):
            rows = slice(a, a + chunk)
            out_C, lse_R[rows] = _run_chunk("forward", fused, logits_RV[rows], local_R[rows].clamp_min(0), temperature)
            target_R[rows] = out_C + lse_R[rows]  # the target's logit / T, meaningful where owned
        target_R = torch.where(owned_R, target_R, torch.zeros((), dtype=acc, device=target_R.device))
        dist.all_reduce(target_R, group=group)
        shards = [torch.empty_like(lse_R) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, lse_R, group=group)
        lse_R = torch.logsumexp(torch.stack(shards), dim=0)
        ctx.save_for_backward(logits_RV, local_R, lse_R)
        ctx.chunk, ctx.temperature, ctx.fused = chunk, temperature, fused
        return target_R - lse_R

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_R: torch.Tensor):
        grad_RV = _ChunkedTargetLogprob.backward(ctx, grad_R)[0]
        return grad_RV, None, None, None, None, None, None


def _align_targets(input_ids_T: torch.Tensor) -> torch.Tensor:
    """Row t predicts token t+1. All T rows go in (the last one with any target, its output is
    dropped): slicing the [T, V] logits would cost a zero-filled [T, V] copy in the backward."""
    return torch.cat([input_ids_T[1:], input_ids_T[:1]]).long()


def _shift_and_mask(next_T: torch.Tensor, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Token-aligned output from the per-row one: 0 at each sequence's first token and on padding."""
    out_T = torch.cat([next_T.new_zeros(1), next_T[:-1]])
    if cu_seqlens is None:
        return out_T
    # Built where cu_seqlens lives (the host, for the backends) and copied without a stream sync:
    # a blocking copy here would make the host wait for the whole forward pass.
    T = out_T.shape[0]
    keep_T = torch.zeros(T, dtype=torch.bool, device=cu_seqlens.device)
    keep_T[: int(cu_seqlens[-1])] = True
    keep_T[cu_seqlens[:-1].long()] = False
    keep_T = keep_T.to(device, non_blocking=True)
    return torch.where(keep_T, out_T, torch.zeros((), dtype=out_T.dtype, device=out_T.device))


def _check_args(logits_TV, input_ids_T, temperature, chunk_tokens, name: str) -> None:
    if logits_TV.dim() != 2:
        raise ValueError(f"{name}: logits must be [T, V], got shape {tuple(logits_TV.shape)}")
    if input_ids_T.shape != (logits_TV.shape[0],):
        raise ValueError(f"{name}: input_ids has shape {tuple(input_ids_T.shape)}, logits have {logits_TV.shape[0]} rows")
    if temperature <= 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"{name}: chunk_tokens must be >= 1, got {chunk_tokens}")


def vocab_parallel_token_logprobs(logits_TV: torch.Tensor, input_ids_T: torch.Tensor, cu_seqlens: torch.Tensor | None,
                                  *, group, vocab_start: int, chunk_tokens: int = 1024, temperature: float = 1.0,
                                  fused: bool | None = None) -> torch.Tensor:
    """:func:`token_logprobs` when ``logits_TV`` holds this rank's vocabulary shard (tensor
    parallelism): columns ``vocab_start ..`` of the full vocabulary, split over ``group``. Every
    rank of ``group`` calls it with the same ``input_ids_T`` and gets the same full logprobs; the
    full-vocabulary logits are never gathered."""
    _check_args(logits_TV, input_ids_T, temperature, chunk_tokens, "vocab_parallel_token_logprobs")
    fused = logits_TV.is_cuda if fused is None else fused
    next_T = _ChunkedVocabParallelLogprob.apply(logits_TV, _align_targets(input_ids_T), int(vocab_start), group,
                                                chunk_tokens, float(temperature), bool(fused))
    return _shift_and_mask(next_T, cu_seqlens, logits_TV.device)


def token_logprobs(logits_TV: torch.Tensor, input_ids_T: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                   *, chunk_tokens: int = 1024, temperature: float = 1.0, fused: bool | None = None) -> torch.Tensor:
    """Token-aligned logprobs [T]: ``out[t] = log_softmax(logits[t-1] / temperature)[ids[t]]``.

    ``out`` is 0 at the first token of each sequence (``cu_seqlens`` boundaries; None = one
    sequence) and on trailing padding after ``cu_seqlens[-1]``. float32 (float64 for float64
    logits); differentiable with respect to ``logits_TV``. ``fused``: compile the chunk math
    (default: on CUDA only; see the module docstring).
    """
    _check_args(logits_TV, input_ids_T, temperature, chunk_tokens, "token_logprobs")
    if logits_TV.shape[0] == 0:
        return logits_TV.sum(-1).to(_acc_dtype(logits_TV.dtype))
    fused = logits_TV.is_cuda if fused is None else fused
    next_T = _ChunkedTargetLogprob.apply(logits_TV, _align_targets(input_ids_T), chunk_tokens, float(temperature), bool(fused))
    return _shift_and_mask(next_T, cu_seqlens, logits_TV.device)


def selected_token_logprobs(logits_RV: torch.Tensor, input_ids_T: torch.Tensor, rows_R: torch.Tensor, *,
                            chunk_tokens: int = 1024, temperature: float = 1.0, fused: bool | None = None) -> torch.Tensor:
    """:func:`token_logprobs` from the logits of some rows only: ``logits_RV[r]`` are row
    ``rows_R[r]``'s (which predicts token ``rows_R[r] + 1``; rows ascending, each below T-1, e.g.
    :attr:`rlcore.data.packing.MicroBatch.logprob_rows_R`). Returns the token-aligned [T] vector with
    those tokens' logprobs and 0 everywhere else; differentiable with respect to ``logits_RV``.

    Computing the LM head on these rows only (Hugging Face models' ``logits_to_keep``) skips the
    full-vocabulary logits of prompt tokens in the forward and the backward; each kept row's value
    is the same computation as :func:`token_logprobs`'s."""
    targets_R, fused = _selected_targets("selected_token_logprobs", logits_RV, input_ids_T, rows_R, temperature, chunk_tokens, fused)
    next_R = _ChunkedTargetLogprob.apply(logits_RV, targets_R, chunk_tokens, float(temperature), fused)
    return _at_next_tokens(next_R, input_ids_T, rows_R)


def vocab_parallel_selected_token_logprobs(logits_RV: torch.Tensor, input_ids_T: torch.Tensor, rows_R: torch.Tensor, *,
                                           group, vocab_start: int, chunk_tokens: int = 1024, temperature: float = 1.0,
                                           fused: bool | None = None) -> torch.Tensor:
    """:func:`selected_token_logprobs` when ``logits_RV`` holds this rank's vocabulary shard
    (columns ``vocab_start ..``, split over ``group``), as :func:`vocab_parallel_token_logprobs`:
    every rank of ``group`` calls it with the same ``input_ids_T`` and ``rows_R`` and gets the same
    token-aligned [T] vector (0 off the selected tokens)."""
    targets_R, fused = _selected_targets("vocab_parallel_selected_token_logprobs", logits_RV, input_ids_T, rows_R,
                                         temperature, chunk_tokens, fused)
    next_R = _ChunkedVocabParallelLogprob.apply(logits_RV, targets_R, int(vocab_start), group, chunk_tokens,
                                                float(temperature), fused)
    return _at_next_tokens(next_R, input_ids_T, rows_R)


def _selected_targets(name: str, logits_RV: torch.Tensor, input_ids_T: torch.Tensor, rows_R: torch.Tensor,
                      temperature: float, chunk_tokens: int, fused: bool | None) -> tuple[torch.Tensor, bool]:
    """The checked arguments of the ``*selected_token_logprobs`` ops: each row's target token, and ``fused`` decided."""
    if logits_RV.dim() != 2 or rows_R.shape != (logits_RV.shape[0],):
        raise ValueError(f"{name}: logits {tuple(logits_RV.shape)} need one row per entry of rows {tuple(rows_R.shape)}")
    _check_args(logits_RV, rows_R, temperature, chunk_tokens, name)
    return input_ids_T[rows_R + 1].long(), bool(logits_RV.is_cuda if fused is None else fused)


def _at_next_tokens(next_R: torch.Tensor, input_ids_T: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
    """The token-aligned [T] vector: row r's value at token ``rows_R[r] + 1``, 0 elsewhere."""
    out_T = torch.zeros(input_ids_T.shape[0], dtype=next_R.dtype, device=next_R.device)
    return out_T.index_put((rows_R + 1,), next_R)


def token_aligned_values(rows_T: torch.Tensor, position_ids_T: torch.Tensor, seq_index_T: torch.Tensor) -> torch.Tensor:
    """A value head's per-row outputs [T] of a packed micro-batch, made token-aligned as logprobs
    are (:mod:`rlcore.interfaces`): ``out[t] = rows[t - 1]``, the value read from the prefix before
    token t, and 0 on each sequence's first token (position 0) and on padding (sequence index -1).
    Differentiable; no host reads (the masks come from the micro-batch's device tensors)."""
    shifted_T = torch.cat([rows_T.new_zeros(1), rows_T[:-1]])
    keep_T = (position_ids_T > 0) & (seq_index_T >= 0)
    return torch.where(keep_T, shifted_T, torch.zeros_like(shifted_T))
