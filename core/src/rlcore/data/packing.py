"""Sequence packing and dynamic batching, shared by every training backend.

A step's sequences (:class:`rlcore.interfaces.SequenceBatch`) are split into micro-batches in
two stages:

1. :func:`plan_micro_batches` decides which sequences go into which micro-batch of which
   data-parallel rank, from their lengths only (every rank computes the same plan).
   ``pack=True`` is dynamic batching by a token budget: sequences are packed into bins of at most
   ``max_tokens`` tokens with a best-fit-decreasing rule (a member of the first-fit-decreasing
   family that packs at least as tightly in practice and runs in O(n log n)), bins are spread
   over ranks by tokens (largest bin to the lightest rank), and every rank gets the same number
   of micro-batches so collectives stay in lockstep: a rank with fewer bins gets empty
   micro-batches, which backends still run as zero-loss steps. ``pack=False`` takes a fixed
   number of sequences per micro-batch.
2. :func:`make_micro_batches` lays one rank's micro-batches out flat: sequences concatenated,
   position ids restarting at 0 for each, ``cu_seqlens`` boundaries, then padding up to a
   multiple of ``pad_to_multiple`` (tensor/context parallelism needs it).

Losses are written over the flat layout; :func:`unpack` cuts per-token outputs back into
per-sequence tensors. :func:`step_totals` gives the global counts a loss divides by, so the step's
gradient is the same whatever the micro-batch geometry.

Sequences whose loss is not a sum over sequences (DPO's and the reward model's pairs) carry the
sequence field ``pack_group`` (:data:`KEEP_TOGETHER_FIELD`): sequences with equal values are
planned as one unit and always land in the same micro-batch of the same rank.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Sequence

import attrs
import numpy as np
import torch

from rlcore.interfaces import SequenceBatch, StepTotals
from rlcore.data.multimodal import ImageInputs

PAD_TOKEN_ID = 0
KEEP_TOGETHER_FIELD = "pack_group"  # seq field: sequences with equal values share a micro-batch


@attrs.define
class MicroBatch:
    """One micro-batch in the flat packed layout (``T`` tokens, ``n`` real sequences)."""

    input_ids_T: torch.Tensor  # int64 [T], sequences concatenated, then padding
    position_ids_T: torch.Tensor  # int64 [T], restarts at 0 for each sequence (padding: 0..)
    cu_seqlens: torch.Tensor  # int32 [n+1], boundaries of the n real sequences (excludes padding)
    max_seqlen: int
    seq_ids: list[int]  # indices of these n sequences in the SequenceBatch
    seq_index_T: torch.Tensor  # int64 [T], 0..n-1 per token, -1 on padding
    loss_mask_T: torch.Tensor  # float [T], 0 on padding and on each sequence's first token
    token_fields: dict[str, torch.Tensor]  # each float [T], token-aligned
    seq_fields: dict[str, torch.Tensor]  # each [n]
    num_padding: int  # trailing pad tokens (input id 0, mask 0)
    # int64 [R]: the rows whose next-token logprob a loss reads (row t-1 for each t with
    # loss_mask_T[t] > 0), ascending: a backend may compute logits on these rows only. None: unknown.
    logprob_rows_R: torch.Tensor | None = None
    # Each of these sequences' prompt images, in ``seq_ids`` order (None where one has none): a
    # sequence's images always travel in its micro-batch. None: a text-only batch.
    images: list[ImageInputs | None] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.numel())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """The token tensors and fields on ``device``; ``cu_seqlens`` stays on the CPU (read on the
        host: no device syncs). ``non_blocking`` from pageable memory: CUDA stages the data before
        the call returns, and torch then skips the stream sync that would make the host wait for
        the previous micro-batch's backward."""
        def to(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return attrs.evolve(
            self, input_ids_T=to(self.input_ids_T), position_ids_T=to(self.position_ids_T),
            seq_index_T=to(self.seq_index_T), loss_mask_T=to(self.loss_mask_T),
            logprob_rows_R=None if self.logprob_rows_R is None else to(self.logprob_rows_R),
            token_fields={k: to(v) for k, v in self.token_fields.items()},
            seq_fields={k: to(v) for k, v in self.seq_fields.items()},
            images=None if self.images is None else _images_to(self.images, device, non_blocking))


def _images_to(per_seq: list[ImageInputs | None], device, non_blocking: bool) -> list[ImageInputs | None]:
    """Each sequence's images on ``device``; an object several sequences share (a GRPO group's prompt
    images) is copied once and stays shared (the trainer encodes it once: rlcore.data.multimodal.SharedImages)."""
    moved: dict[int, ImageInputs] = {}
    for images in per_seq:
        if images is not None and id(images) not in moved:
            moved[id(images)] = images.to(device, non_blocking=non_blocking)
    return [None if images is None else moved[id(images)] for images in per_seq]


# ---- planning --------------------------------------------------------------------------------
def _check_lengths(lengths: Sequence[int]) -> np.ndarray:
    lengths_N = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lengths_N.size and lengths_N.min() < 1:
        bad = int(np.argmin(lengths_N))
        raise ValueError(f"sequence {bad} has length {int(lengths_N[bad])}; every sequence needs at least one token")
    return lengths_N


def _pack_bins(lengths_N: np.ndarray, max_tokens: int, affinity: Sequence[Hashable | None] | None = None) -> list[list[int]]:
    """Best-fit decreasing: each sequence (longest first) goes to the open bin whose free space
    is the smallest that still fits it. ``free`` is a sorted list of free capacities, with the
    bins holding each capacity in ``bins_by_free``; both updates are O(log bins) bisects plus a
    C-level memmove, which keeps 100k sequences well under a second.

    ``affinity``: a key per sequence (None: none). The sequences are then placed key by key (the key
    with the most tokens first; each key's longest first; those without a key last), and a sequence
    whose key is already in an open bin with room for it goes to the fullest such bin instead (the
    samples of one image prompt then share micro-batches, whose vision tower encodes the image once)."""
    too_long = np.flatnonzero(lengths_N > max_tokens)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"sequence {i} has {int(lengths_N[i])} tokens, more than the micro-batch budget max_tokens={max_tokens} "
            f"({too_long.size} sequence(s) too long); raise the token budget or lower the sequence length limit"
        )
    order = np.argsort(-lengths_N, kind="stable")
    if affinity is not None:  # key by key (the longest key first), each key's sequences longest first
        totals: dict[Hashable, int] = {}
        for i, key in enumerate(affinity):
            if key is not None:
                totals[key] = totals.get(key, 0) + int(lengths_N[i])
        rank = {key: r for r, key in enumerate(sorted(totals, key=lambda k: -totals[k]))}
        order = np.array(sorted(order.tolist(), key=lambda i: len(rank) if affinity[i] is None else rank[affinity[i]]),
                         dtype=np.int64)
    bins: list[list[int]] = []
    free: list[int] = []
    bins_by_free: dict[int, list[int]] = {}
    space_of: list[int] = []  # each bin's free tokens
    bins_by_key: dict[Hashable, set[int]] = {}
    for idx, length in zip(order.tolist(), lengths_N[order].tolist()):
        key = None if affinity is None else affinity[idx]
        kin = [b for b in bins_by_key.get(key, ()) if space_of[b] >= length] if key is not None else []
        if kin:
            b = min(kin, key=lambda k: (space_of[k], k))
            space = space_of[b]
            if space:  # a bin with no room left is in neither ``free`` nor ``bins_by_free``
                free.pop(bisect.bisect_left(free, space))
                bins_by_free[space].remove(b)
        else:
            pos = bisect.bisect_left(free, length)
            if pos == len(free):
                b, space = len(bins), max_tokens
                bins.append([])
                space_of.append(max_tokens)
            else:
                space = free.pop(pos)
                b = bins_by_free[space].pop()
        bins[b].append(idx)
        if key is not None:
            bins_by_key.setdefault(key, set()).add(b)
        left = space_of[b] = space - length
        if left > 0:
            bisect.insort(free, left)
            bins_by_free.setdefault(left, []).append(b)
    return [sorted(b) for b in bins]


def _spread_over_ranks(bins: list[list[int]], bin_tokens: list[int], dp_size: int) -> list[list[list[int]]]:
    """Largest bin first to the rank with the fewest tokens so far; then pad to equal counts."""
    ranks: list[list[list[int]]] = [[] for _ in range(dp_size)]
    heap = [(0, 0, r) for r in range(dp_size)]  # (tokens, micro-batches, rank)
    for b in sorted(range(len(bins)), key=lambda i: (-bin_tokens[i], i)):
        tokens, count, r = heapq.heappop(heap)
        ranks[r].append(bins[b])
        heapq.heappush(heap, (tokens + bin_tokens[b], count + 1, r))
    return _equalize(ranks)


def _equalize(ranks: list[list[list[int]]]) -> list[list[list[int]]]:
    most = max((len(r) for r in ranks), default=0)
    most = max(most, 1)  # even an empty step runs one (empty) micro-batch everywhere
    for r in ranks:
        r.extend([] for _ in range(most - len(r)))
    return ranks


def _units(groups: Sequence[int], n: int) -> list[list[int]]:
    """Sequence indices grouped by equal ``groups`` value, in order of first appearance."""
    if len(groups) != n:
        raise ValueError(f"{KEEP_TOGETHER_FIELD} has {len(groups)} entries, the batch has {n} sequences")
    units: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        units.setdefault(int(g), []).append(i)
    return list(units.values())


def plan_grouped_micro_batches(lengths: Sequence[int], groups: Sequence[int], max_tokens: int, dp_size: int = 1, *,
                               pack: bool = True, micro_batch_size: int | None = None) -> list[list[list[int]]]:
    """:func:`plan_micro_batches` where the sequences sharing a ``groups`` value are one unit: a
    unit is never split across micro-batches or ranks (its total length must fit ``max_tokens``;
    without packing, a micro-batch takes whole units up to ``micro_batch_size`` sequences, at least one)."""
    lengths_N = _check_lengths(lengths)
    units = _units(groups, lengths_N.size)
    unit_lengths = [int(lengths_N[u].sum()) for u in units]
    if not pack:
        if micro_batch_size is None or micro_batch_size < 1:
            raise ValueError(f"pack=False needs micro_batch_size >= 1, got {micro_batch_size}")
        per_mb = max(1, micro_batch_size // max((len(u) for u in units), default=1))
        plan = plan_micro_batches([1] * len(units), 1, dp_size, pack=False, micro_batch_size=per_mb)
    else:
        too_long = [i for i, n in enumerate(unit_lengths) if n > max_tokens]
        if too_long:
            u = units[too_long[0]]
            raise ValueError(f"sequences {u} ({KEEP_TOGETHER_FIELD} {int(groups[u[0]])}) must share a micro-batch but "
                             f"have {unit_lengths[too_long[0]]} tokens together, more than max_tokens={max_tokens}; "
                             "raise the token budget or lower the sequence length limit")
        plan = plan_micro_batches(unit_lengths, max_tokens, dp_size)
    return [[sorted(i for unit in mb for i in units[unit]) for mb in rank] for rank in plan]


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, dp_size: int = 1, *,
                       pack: bool = True, micro_batch_size: int | None = None,
                       affinity: Sequence[Hashable | None] | None = None) -> list[list[list[int]]]:
    """[dp_rank][micro_batch] -> sequence indices (ascending within a micro-batch).

    ``pack=True``: bins of at most ``max_tokens`` tokens (a longer sequence is a ValueError naming
    it), balanced across ranks by tokens; sequences with the same ``affinity`` key share a bin where
    one has room (see :func:`_pack_bins`). ``pack=False``: ``micro_batch_size`` sequences per
    micro-batch, ranks taking contiguous shards of the batch. Either way every rank gets the same
    number of micro-batches; the shorter ranks' extra micro-batches are empty lists.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    lengths_N = _check_lengths(lengths)
    if not pack:
        if micro_batch_size is None or micro_batch_size < 1:
            raise ValueError(f"pack=False needs micro_batch_size >= 1, got {micro_batch_size}")
        shards = np.array_split(np.arange(lengths_N.size), dp_size)
        ranks = [[s[i : i + micro_batch_size].tolist() for i in range(0, s.size, micro_batch_size)] for s in shards]
        return _equalize(ranks)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if affinity is not None and len(affinity) != lengths_N.size:
        raise ValueError(f"affinity has {len(affinity)} keys, there are {lengths_N.size} sequences")
    bins = _pack_bins(lengths_N, max_tokens, affinity)
    return _spread_over_ranks(bins, [int(lengths_N[b].sum()) for b in bins], dp_size)


# ---- layout ----------------------------------------------------------------------------------
def _flat(tensors: list[torch.Tensor], total: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Concatenate 1-D tensors and zero-pad to ``total`` entries."""
    if tensors:
        flat = torch.cat([t.reshape(-1) for t in tensors])
    else:
        flat = torch.zeros(0, dtype=dtype or torch.float32)
    if dtype is not None:
        flat = flat.to(dtype)
    return torch.nn.functional.pad(flat, (0, total - flat.numel()))


def _check_batch(batch: SequenceBatch) -> None:
    n = len(batch.input_ids)
    if len(batch.loss_mask) != n:
        raise ValueError(f"SequenceBatch has {n} input_ids but {len(batch.loss_mask)} loss_mask entries")
    for name, values in batch.token_fields.items():
        if len(values) != n:
            raise ValueError(f"token field '{name}' has {len(values)} sequences, input_ids has {n}")
    for i, ids in enumerate(batch.input_ids):
        if ids.dim() != 1:
            raise ValueError(f"input_ids[{i}] must be 1-D, got shape {tuple(ids.shape)}")
        if batch.loss_mask[i].shape != ids.shape:
            raise ValueError(f"loss_mask[{i}] has shape {tuple(batch.loss_mask[i].shape)}, input_ids[{i}] has {tuple(ids.shape)}")
        for name, values in batch.token_fields.items():
            if values[i].shape != ids.shape:
                raise ValueError(
                    f"token field '{name}'[{i}] has shape {tuple(values[i].shape)}, input_ids[{i}] has {tuple(ids.shape)}"
                )
    if batch.images is not None and len(batch.images) != n:
        raise ValueError(f"SequenceBatch has {n} input_ids but {len(batch.images)} images entries")
    for name, values in batch.seq_fields.items():
        if values.shape[:1] != (n,):
            raise ValueError(f"seq field '{name}' has shape {tuple(values.shape)}, expected [{n}] (one per sequence)")


def _layout(batch: SequenceBatch, seq_ids: list[int], pad_to_multiple: int) -> MicroBatch:
    lengths = [int(batch.input_ids[i].numel()) for i in seq_ids]
    used = sum(lengths)
    # An empty micro-batch still gets pad tokens so that backends can run a real forward on it.
    total = max(-(-used // pad_to_multiple) * pad_to_multiple, pad_to_multiple if not seq_ids else 0)
    num_padding = total - used
    cu = torch.zeros(len(seq_ids) + 1, dtype=torch.int32)
    if lengths:
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    position_ids_T = torch.cat([torch.arange(n, dtype=torch.int64) for n in [*lengths, num_padding]])
    seq_index_T = torch.cat([torch.full((n,), j, dtype=torch.int64) for j, n in enumerate(lengths)]
                            + [torch.full((num_padding,), -1, dtype=torch.int64)])
    loss_mask_T = _flat([batch.loss_mask[i] for i in seq_ids], total, torch.float32)
    loss_mask_T[cu[:-1].long()] = 0.0  # a sequence's first token has no logprob
    token_fields = {}
    for name, values in batch.token_fields.items():
        dtype = values[seq_ids[0]].dtype if seq_ids and values[seq_ids[0]].is_floating_point() else torch.float32
        token_fields[name] = _flat([values[i] for i in seq_ids], total, dtype)
    return MicroBatch(
        input_ids_T=_flat([batch.input_ids[i] for i in seq_ids], total, torch.int64),
        position_ids_T=position_ids_T,
        cu_seqlens=cu,
        max_seqlen=max(lengths, default=0),
        seq_ids=list(seq_ids),
        seq_index_T=seq_index_T,
        loss_mask_T=loss_mask_T,
        token_fields=token_fields,
        seq_fields={name: values[list(seq_ids)] for name, values in batch.seq_fields.items()},
        num_padding=num_padding,
        logprob_rows_R=torch.nonzero(loss_mask_T[1:] > 0).flatten(),
        images=None if batch.images is None else [batch.images[i] for i in seq_ids],
    )


def make_micro_batches(batch: SequenceBatch, max_tokens: int, dp_rank: int = 0, dp_size: int = 1, *,
                       pad_to_multiple: int = 1, pack: bool = True,
                       micro_batch_size: int | None = None) -> list[MicroBatch]:
    """This rank's micro-batches; each one's length is padded up to a multiple of ``pad_to_multiple``
    (TP, or 2*CP*TP for Megatron). Empty micro-batches (see :func:`plan_micro_batches`) have no
    sequences and ``pad_to_multiple`` pad tokens."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    _check_batch(batch)
    groups = batch.seq_fields.get(KEEP_TOGETHER_FIELD)
    if groups is not None:
        plan = plan_grouped_micro_batches(batch.lengths(), groups.tolist(), max_tokens, dp_size, pack=pack,
                                          micro_batch_size=micro_batch_size)
    else:
        plan = plan_micro_batches(batch.lengths(), max_tokens, dp_size, pack=pack, micro_batch_size=micro_batch_size,
                                  affinity=_image_prompt_keys(batch))
    return [_layout(batch, seq_ids, pad_to_multiple) for seq_ids in plan[dp_rank]]


def _image_prompt_keys(batch: SequenceBatch) -> list[bytes | None] | None:
    """Each image sequence's prompt (its ids before the first trained token) as a packing affinity key:
    the samples of one image prompt then share micro-batches, whose vision tower encodes the image
    once (:class:`rlcore.data.multimodal.SharedImages`). Keys from the ids, not the images objects, so every
    rank plans the same micro-batches; two prompts with equal ids are packed together, which is harmless.
    None for a batch without images."""
    if batch.images is None:
        return None
    keys: list[bytes | None] = []
    for ids, mask, images in zip(batch.input_ids, batch.loss_mask, batch.images):
        trained = torch.nonzero(mask.reshape(-1) > 0)
        prompt_len = int(trained[0]) if trained.numel() else ids.numel()
        keys.append(None if images is None else ids.reshape(-1)[:prompt_len].cpu().numpy().tobytes())
    return keys


def unpack(values_T: torch.Tensor, mb: MicroBatch) -> list[torch.Tensor]:
    """Per-token values [T] -> list of per-sequence tensors [L_i] (in ``mb.seq_ids`` order)."""
    if values_T.shape[:1] != mb.input_ids_T.shape:
        raise ValueError(f"unpack: values have shape {tuple(values_T.shape)}, the micro-batch has {mb.num_tokens} tokens")
    cu = mb.cu_seqlens.tolist()
    return [values_T[a:b] for a, b in zip(cu[:-1], cu[1:])]


def step_totals(batch: SequenceBatch) -> StepTotals:
    """Global counts of the step: valid tokens = sum of loss_mask (first tokens excluded, as in
    the packed layout); valid sequences = sequences with any valid token. A step with no valid
    token is an error: every response is masked and the loss would be 0/0."""
    per_seq = [float(m.reshape(-1)[1:].float().sum()) for m in batch.loss_mask]
    num_tokens = int(round(sum(per_seq)))
    if num_tokens == 0:
        raise ValueError(f"all {len(batch.loss_mask)} sequences of the step have an all-zero loss_mask "
                         "(every response is masked); there is nothing to train on")
    return StepTotals(num_valid_tokens=num_tokens, num_valid_seqs=sum(1 for s in per_seq if s > 0))
