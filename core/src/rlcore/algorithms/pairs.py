"""What the pairwise losses (DPO, the reward model) share: the layout of a preference batch and
the matching of each micro-batch's chosen and rejected sequences.

A preference batch (:class:`rlcore.interfaces.SequenceBatch`) holds each pair as two sequences
(prompt + chosen, prompt + rejected), with the sequence fields ``pack_group`` (the pair's index,
so that packing keeps the two in one micro-batch: :data:`rlcore.data.packing.KEEP_TOGETHER_FIELD`)
and ``chosen`` (1.0 or 0.0). Every sequence has at least one response token, so a step's pairs
are ``StepTotals.num_valid_seqs / 2``.
"""

from __future__ import annotations

import torch

from rlcore.interfaces import PreferencePair, SequenceBatch
from rlcore.data.packing import KEEP_TOGETHER_FIELD, MicroBatch

CHOSEN_FIELD = "chosen"


def pair_index(name: str, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(pair slot of each sequence [n] in 0..p-1, sign [n]: +1 chosen / -1 rejected, p), checking
    that every pair of the micro-batch has exactly one chosen and one rejected sequence."""
    for field in (KEEP_TOGETHER_FIELD, CHOSEN_FIELD):
        if field not in mb.seq_fields:
            raise ValueError(f"{name}.loss: sequence field '{field}' is missing; {name} trains on preference pairs "
                             f"(data.name: preference), have {sorted(mb.seq_fields)}")
    groups_n = mb.seq_fields[KEEP_TOGETHER_FIELD]
    chosen_n = mb.seq_fields[CHOSEN_FIELD]
    ids_p, slot_n, counts_p = torch.unique(groups_n, return_inverse=True, return_counts=True)
    chosen_p = torch.zeros(ids_p.numel(), dtype=torch.float64, device=chosen_n.device).index_add(0, slot_n, chosen_n.double())
    bad = ((counts_p != 2) | (chosen_p != 1)).nonzero().flatten()
    if bad.numel():
        p = int(bad[0])
        raise ValueError(f"{name}.loss: pair {int(ids_p[p])} has {int(counts_p[p])} sequence(s) in this micro-batch, "
                         f"{int(chosen_p[p])} of them chosen; each pair needs one chosen and one rejected sequence together")
    return slot_n, chosen_n * 2 - 1, int(ids_p.numel())


def num_pairs(name: str, totals) -> float:
    """The step's pairs (every sequence of a preference batch is valid)."""
    if totals.num_valid_seqs % 2:
        raise ValueError(f"{name}.loss: the step has {totals.num_valid_seqs} valid sequences, not an even number: "
                         "a preference batch needs a response token in every chosen and rejected sequence")
    return totals.num_valid_seqs / 2


def pair_batch(pairs: list[PreferencePair], max_length: int | None = None) -> SequenceBatch:
    """Pair i as sequences 2i (prompt + chosen) and 2i + 1 (prompt + rejected), trained on the
    response tokens; a sequence over ``max_length`` tokens is an error naming its pair's source."""
    ids, masks, group, chosen = [], [], [], []
    for i, pair in enumerate(pairs):
        for response, is_chosen in ((pair.chosen_ids, 1.0), (pair.rejected_ids, 0.0)):
            n = len(pair.prompt_ids) + len(response)
            if max_length is not None and n > max_length:
                raise ValueError(f"{pair.source or f'pair {i}'}: prompt + {'chosen' if is_chosen else 'rejected'} is "
                                 f"{n} tokens, over policy.max_total_sequence_length={max_length}")
            if not response:
                raise ValueError(f"{pair.source or f'pair {i}'}: empty {'chosen' if is_chosen else 'rejected'} response")
            ids.append(torch.tensor(list(pair.prompt_ids) + list(response), dtype=torch.long))
            masks.append(torch.cat([torch.zeros(len(pair.prompt_ids)), torch.ones(len(response))]))
            group.append(i)
            chosen.append(is_chosen)
    return SequenceBatch(input_ids=ids, loss_mask=masks,
                         seq_fields={KEEP_TOGETHER_FIELD: torch.tensor(group, dtype=torch.long),
                                     CHOSEN_FIELD: torch.tensor(chosen)})


def response_logprob_sums(logprobs: list[torch.Tensor], batch: SequenceBatch) -> torch.Tensor:
    """Sum over each sequence's response tokens of token-aligned logprobs [2P]."""
    return torch.stack([(lp.double() * m.double())[1:].sum() for lp, m in zip(logprobs, batch.loss_mask)])
