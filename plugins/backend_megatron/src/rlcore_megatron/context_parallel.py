"""Context parallelism for packed micro-batches without Transformer Engine.

Megatron's thd convention under CP (the one its RoPE follows): every sequence is padded to a
multiple of ``2*CP`` (here ``2*CP*TP`` so that sequence parallelism also divides), cut into
``2*CP`` chunks, and CP rank ``r`` holds chunks ``r`` and ``2*CP-1-r`` of every sequence (load
balance under the causal mask). ``cu_seqlens`` given to the model are the *global* padded
boundaries.

Attention (:func:`cp_attention`) all-gathers K/V over the CP group (with autograd) and lets each
local query chunk attend causally to the keys before it. Logprobs (:func:`cp_logprobs`): each
rank computes next-token logprobs for its own positions, scatters them into the global layout
and an autograd all-reduce over CP gives every rank the full token-aligned vector, so any
algorithm (token- or sequence-level) sees whole sequences. Only the positions that predict a
loss-masked token (:attr:`CPLayout.rows_R`, from ``MicroBatch.logprob_rows_R``) go through the
output layer (:mod:`rlcore_megatron.output`); the other tokens' logprobs are 0.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed.nn.functional as dist_nn
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams

from rlcore.data.packing import MicroBatch
from rlcore_megatron.output import output_logits


@attrs.frozen
class CPLayout:
    """Where the micro-batch's tokens are in the padded global layout and on this rank."""

    cu_padded: tuple[int, ...]  # global boundaries of the padded segments (sequences + trailing padding)
    local_idx: torch.Tensor  # int64 [P/cp]: global padded positions held by this rank
    labels_P: torch.Tensor  # int64 [P]: next token of each padded position (0 where none)
    src_T: torch.Tensor  # int64 [T]: padded position whose prediction is token t's logprob
    valid_T: torch.Tensor  # bool [T]: token t has a logprob (not first of its sequence, not padding)
    # int64 [R]: this rank's rows (into its P/cp local positions) whose logits a loss reads; None: every row.
    # Never empty (one row is kept when none is needed): the TP collectives of the logprob kernel want rows.
    rows_R: torch.Tensor | None = None


def _chunks(length: int, cp: int, rank: int) -> tuple[int, int]:
    c = length // (2 * cp)
    return rank * c, (2 * cp - 1 - rank) * c


def layout(mb: MicroBatch, cp: int, rank: int, multiple: int) -> CPLayout:
    cu = mb.cu_seqlens.tolist()
    segments = [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    if mb.num_padding:
        segments.append((cu[-1], cu[-1] + mb.num_padding))
    ids_T = mb.input_ids_T
    cu_padded, labels, local, src = [0], [], [], torch.zeros(ids_T.numel(), dtype=torch.long)
    valid = torch.zeros(ids_T.numel(), dtype=torch.bool)
    for i, (start, end) in enumerate(segments):
        n = end - start
        padded = -(-n // multiple) * multiple
        base = cu_padded[-1]
        seg_labels = torch.zeros(padded, dtype=torch.long)
        seg_labels[: n - 1] = ids_T[start + 1 : end]
        labels.append(seg_labels)
        c = padded // (2 * cp)
        for a in _chunks(padded, cp, rank):
            local.append(torch.arange(base + a, base + a + c))
        if i < len(cu) - 1 and n > 1:  # a real sequence: token j (>= 1) is predicted at position j-1
            src[start + 1 : end] = torch.arange(base, base + n - 1)
            valid[start + 1 : end] = True
        cu_padded.append(base + padded)
    local_idx = torch.cat(local)
    return CPLayout(tuple(cu_padded), local_idx, torch.cat(labels), src, valid,
                    _local_rows(mb.logprob_rows_R, src, local_idx, cu_padded[-1]))


def _local_rows(logprob_rows_R: torch.Tensor | None, src_T: torch.Tensor, local_idx: torch.Tensor, total: int):
    """This rank's local rows predicting the tokens ``logprob_rows_R + 1`` (None: all rows)."""
    if logprob_rows_R is None:
        return None
    needed_P = torch.zeros(total, dtype=torch.bool)
    needed_P[src_T[logprob_rows_R.cpu() + 1]] = True
    rows_R = torch.nonzero(needed_P[local_idx]).flatten()
    return rows_R if rows_R.numel() else torch.zeros(1, dtype=torch.long)


def inputs(mb: MicroBatch, lay: CPLayout, device) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams]:
    """This rank's ids/positions [1, P/cp] and the global-boundary thd params."""
    total = lay.cu_padded[-1]
    ids_P = torch.zeros(total, dtype=torch.long)
    pos_P = torch.zeros(total, dtype=torch.long)
    cu = mb.cu_seqlens.tolist()
    starts = cu[:-1] + ([cu[-1]] if mb.num_padding else [])
    for i, start in enumerate(starts):
        n = (cu[i + 1] if i < len(cu) - 1 else cu[-1] + mb.num_padding) - start
        base = lay.cu_padded[i]
        ids_P[base : base + n] = mb.input_ids_T[start : start + n]
        pos_P[base : lay.cu_padded[i + 1]] = torch.arange(lay.cu_padded[i + 1] - base)
    cu_t = torch.tensor(lay.cu_padded, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(lay.cu_padded[:-1], lay.cu_padded[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, max_seqlen_q=longest, max_seqlen_kv=longest)
    params.host_bounds = lay.cu_padded
    return ids_P[lay.local_idx].to(device)[None], pos_P[lay.local_idx].to(device)[None], params


def cp_logprobs(model, lay: CPLayout, hidden_S1H: torch.Tensor) -> torch.Tensor:
    """Token-aligned logprobs [T] of the whole micro-batch, on every CP rank (differentiable), from
    this rank's last-stage hidden states: the output layer runs on ``lay.rows_R`` only."""
    from megatron.core import tensor_parallel

    device = hidden_S1H.device
    positions = lay.local_idx if lay.rows_R is None else lay.local_idx[lay.rows_R]
    logits_RV = output_logits(model, hidden_S1H, None if lay.rows_R is None else lay.rows_R.to(device))
    positions = positions.to(device)
    local_lp = -tensor_parallel.vocab_parallel_cross_entropy(logits_RV.float(), lay.labels_P.to(device)[positions])
    full_P = torch.zeros(lay.cu_padded[-1], dtype=local_lp.dtype, device=device).index_put((positions,), local_lp)
    full_P = dist_nn.all_reduce(full_P, group=mpu.get_context_parallel_group())
    out_T = full_P[lay.src_T.to(device)]
    return torch.where(lay.valid_T.to(device), out_T, torch.zeros_like(out_T))


def cp_attention(query_THD: torch.Tensor, key_TGD: torch.Tensor, value_TGD: torch.Tensor, params: PackedSeqParams, *,
                 scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's query chunks over the all-gathered keys/values of each sequence.

    One :func:`rlcore.training.attention.packed_causal_attention` call for the whole micro-batch: each local
    query chunk (``c`` tokens at global chunk offset ``a``) is a segment whose keys are the
    sequence's first ``a + c`` keys, with the causal mask aligned to the bottom right. On CUDA in
    bf16 that is one FlashAttention varlen kernel (an explicit boolean mask instead sent SDPA to
    its math backend: over a hundred GiB and minutes per step at 16k tokens, CP=2).
    """
    from rlcore.training.attention import packed_causal_attention

    group = mpu.get_context_parallel_group()
    cp, rank = group.size(), group.rank()
    cu = getattr(params, "host_bounds", None) or params.cu_seqlens_q.tolist()
    t_local = query_THD.shape[0]
    keys = torch.cat(dist_nn.all_gather(key_TGD.contiguous(), group=group))
    values = torch.cat(dist_nn.all_gather(value_TGD.contiguous(), group=group))
    key_index, cu_q, cu_k = [], [0], [0]
    for start, end in zip(cu[:-1], cu[1:]):
        length, off = end - start, start // cp
        c = length // (2 * cp)
        # Global chunk j of this sequence sits in rank min(j, 2cp-1-j)'s shard: first half for j < cp.
        order = [(j * t_local + off + torch.arange(c)) if j < cp else ((2 * cp - 1 - j) * t_local + off + c + torch.arange(c))
                 for j in range(2 * cp)]
        in_order = torch.cat(order)
        for a in _chunks(length, cp, rank):
            key_index.append(in_order[: a + c])
            cu_q.append(cu_q[-1] + c)
            cu_k.append(cu_k[-1] + a + c)
    index = torch.cat(key_index).to(keys.device)
    device = query_THD.device
    out_THD = packed_causal_attention(
        query_THD, keys[index], values[index], torch.tensor(cu_q, dtype=torch.int32, device=device),
        max(b - a for a, b in zip(cu_q[:-1], cu_q[1:])), scale=scale, dropout=dropout,
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device), max_len_k=max(b - a for a, b in zip(cu_k[:-1], cu_k[1:])))
    return out_THD.reshape(out_THD.shape[0], -1)
