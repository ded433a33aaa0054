"""The output layer (LM head) and logprobs on the rows a loss reads.

The backend's model (:class:`rlcore_megatron.model.PolicyGPTModel`) returns its last stage's
final hidden states; the loss function runs the output layer here, on the rows whose
next-token logprob the loss, KL term or refit probe reads (``MicroBatch.logprob_rows_R``: the
row before each loss-masked token), never on prompt rows: the ``[rows, V/tp]`` logits, their
logprob kernel and their backward shrink by the prompt's share of the stream. Megatron's own
``_postprocess`` runs ``output_layer`` on every row; verl's fused forward likewise returns hidden
states from the last stage and runs the head itself (``verl/models/mcore/model_forward_fused.py``).

Every layout rlcore supports selects:

- TP: each rank holds every row; it selects, computes its vocabulary shard of the selected
  rows' logits and :func:`rlcore.training.ops.vocab_parallel_selected_token_logprobs` combines the shards.
- TP + sequence parallelism: each rank holds ``T/tp`` rows. They are all-gathered over TP (the
  gather the output layer would do itself, same volume), selected, and the output layer runs with
  its own gather switched off; its input-gradient all-reduce then gives every rank the whole
  gradient, of which the gather's backward keeps this rank's slice (``tensor_parallel_output_grad=False``
  instead of a reduce-scatter, which would sum the already summed gradient again).
- CP: each rank selects among the rows of its own chunks (:attr:`rlcore_megatron.context_parallel.CPLayout.rows_R`);
  :func:`rlcore_megatron.context_parallel.cp_logprobs` all-reduces the scattered values over CP.
- PP: only the last stage has the output layer and calls the loss; other stages are unchanged.

Without a selection (``logprob_rows_R`` None, or no row to select) every row goes through the
output layer exactly as in Megatron's ``_postprocess`` (and values are given on every token).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from rlcore.training.ops import (selected_token_logprobs, token_logprobs, vocab_parallel_selected_token_logprobs,
                        vocab_parallel_token_logprobs)
from rlcore.data.packing import MicroBatch


@contextlib.contextmanager
def _own_gather_off(layer):
    """The output layer without its sequence-parallel all-gather (the caller gathered). Megatron's
    ``_postprocess`` does the same for its last-token inference path; the autograd function
    records the flag at forward time, so the backward is unaffected by restoring it."""
    saved, layer.sequence_parallel = layer.sequence_parallel, False
    try:
        yield
    finally:
        layer.sequence_parallel = saved


def output_logits(model, hidden_S1H: torch.Tensor, rows_R: torch.Tensor | None = None) -> torch.Tensor:
    """This TP rank's vocabulary shard of the logits ``[R, V/tp]`` of rows ``rows_R`` of this rank's
    token stream (the whole micro-batch, or this CP rank's chunks; rows of the sequence-gathered
    stream under sequence parallelism); every row when ``rows_R`` is None. ``model``: the
    (unwrapped) :class:`rlcore_megatron.model.PolicyGPTModel`; ``hidden_S1H``: its last stage's output."""
    layer = model.output_layer
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if rows_R is None:
        logits_S1V, _ = layer(hidden_S1H, weight=weight)
        return logits_S1V.squeeze(1)  # squeeze, not [:, 0]: indexing's backward would fill a zero [T, V] tensor
    gathered = layer.sequence_parallel
    if gathered:
        hidden_S1H = gather_from_sequence_parallel_region(hidden_S1H, tensor_parallel_output_grad=False, group=layer.tp_group)
    selected_R1H = hidden_S1H.index_select(0, rows_R)
    with _own_gather_off(layer) if gathered else contextlib.nullcontext():
        logits_R1V, _ = layer(selected_R1H, weight=weight)
    return logits_R1V.squeeze(1)


def micro_batch_logprobs(model, mb: MicroBatch, hidden_S1H: torch.Tensor) -> torch.Tensor:
    """Token-aligned logprobs [T] (float32) of a device micro-batch from the last stage's hidden
    states: ``out[t] = log_softmax(logits[t-1])[ids[t]]`` on the tokens ``mb.logprob_rows_R``
    selects (0 elsewhere), or on every token but each sequence's first when it selects nothing."""
    rows_R = mb.logprob_rows_R
    if rows_R is not None and rows_R.numel() > 0:  # the same on every TP rank: one micro-batch
        return selected_rows_logprobs(model, hidden_S1H, mb.input_ids_T, rows_R)
    logits_TV = output_logits(model, hidden_S1H)
    if mpu.get_tensor_model_parallel_world_size() == 1:
        return token_logprobs(logits_TV, mb.input_ids_T, mb.cu_seqlens)
    group, start = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank() * logits_TV.shape[-1]
    return vocab_parallel_token_logprobs(logits_TV, mb.input_ids_T, mb.cu_seqlens, group=group, vocab_start=start)


def selected_rows_logprobs(model, hidden_S1H: torch.Tensor, input_ids_T: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
    """Token-aligned logprobs ``[len(input_ids_T)]``: row ``rows_R[r]``'s logprob of token
    ``input_ids_T[rows_R[r] + 1]`` at that token, 0 elsewhere (the output layer on those rows only).
    ``input_ids_T`` may be longer than the stream: the CUDA-graph path points padded rows at one
    extra slot past its end (:mod:`rlcore_megatron.cuda_graph`)."""
    logits_RV = output_logits(model, hidden_S1H, rows_R)
    if mpu.get_tensor_model_parallel_world_size() == 1:
        return selected_token_logprobs(logits_RV, input_ids_T, rows_R)
    group, start = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank() * logits_RV.shape[-1]
    return vocab_parallel_selected_token_logprobs(logits_RV, input_ids_T, rows_R, group=group, vocab_start=start)
