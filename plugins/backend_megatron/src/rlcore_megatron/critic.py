"""PPO's critic on the Megatron backend: the GPT model with an output layer of size one.

:class:`MegatronCritic` is the backend (:mod:`rlcore_megatron.backend`) with the vocabulary
output layer replaced by a value head, a ``Linear(hidden, 1)`` on the last pipeline stage (its
weights ``score.weight`` / ``score.bias`` in Hugging Face names, :mod:`rlcore.training.value_model`). The
head is one row wide, so it is not split: every tensor-parallel rank holds all of it and computes
the same values from the same final hidden states. Its gradient is then whole on each rank (no
tensor-parallel reduction, not marked ``sequence_parallel``), Megatron's DDP sums it over the
data-parallel ranks like any weight, and the gradient norm counts it once (it carries no
``tensor_model_parallel`` flag, so only tensor-parallel rank 0 counts it).

Per layout, from the last stage's hidden states (as :mod:`rlcore_megatron.output` does for logits):

- TP: every rank holds every row; the head runs on all of them.
- TP + sequence parallelism: the rank's ``T/tp`` rows are all-gathered (backward: this rank's
  slice of the whole gradient each rank computed), then the head runs on every row.
- CP: each rank runs the head on its own chunks' rows, scatters them into the padded global
  layout and an autograd all-reduce over CP gives every rank the whole token-aligned vector, as
  :func:`rlcore_megatron.context_parallel.cp_logprobs` does for logprobs.
- PP: the last stage owns the head; the other stages are the policy's.

Values are token-aligned (:func:`rlcore.training.ops.token_aligned_values`): token t reads row t-1.
Training, checkpoints (``dist_checkpointing``; the head as a replicated tensor), offloading and
the Hugging Face export (a token-classification checkpoint) are the backend's. MoE routing replay
and CUDA graphs are the policy's alone: the critic runs without them.
"""

from __future__ import annotations

from functools import partial

import attrs
import torch
import torch.distributed.nn.functional as dist_nn
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from rlcore.config import RunConfig
from rlcore.interfaces import SequenceBatch, WorldInfo
from rlcore.training.ops import token_aligned_values
from rlcore.data.packing import MicroBatch
from rlcore.training.steps import train_in_optimizer_steps
from rlcore.training.value_model import is_value_model, value_model_config
from rlcore_megatron import context_parallel, cpu_shims, parallel
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.config import MegatronConfig
from rlcore_megatron.convert import load_hf_into_megatron
from rlcore_megatron.model import packed_seq_params


def build_critic(config: RunConfig, section_config: MegatronConfig, world: WorldInfo) -> MegatronCritic:
    """Factory named by the ``megatron`` registration's ``critic`` capability (:mod:`rlcore.controller.critic_step`)."""
    cfg = attrs.evolve(section_config, cuda_graph="none", moe_router_replay="none", moe_routing_metrics=False)
    return MegatronCritic(config, cfg, world)


def head_values(model, hidden_S1H: torch.Tensor) -> torch.Tensor:
    """The value head on every row of this rank's stream [S] (sequence-gathered under sequence parallelism)."""
    if model.config.sequence_parallel:
        hidden_S1H = gather_from_sequence_parallel_region(hidden_S1H, tensor_parallel_output_grad=False,
                                                          group=mpu.get_tensor_model_parallel_group())
    return model.value_head(hidden_S1H.squeeze(1)).squeeze(-1)


def micro_batch_values(model, mb: MicroBatch, hidden_S1H: torch.Tensor) -> torch.Tensor:
    """Token-aligned values [T] of a device micro-batch (no context parallelism)."""
    return token_aligned_values(head_values(model, hidden_S1H).float(), mb.position_ids_T, mb.seq_index_T)


def cp_values(model, lay: context_parallel.CPLayout, hidden_S1H: torch.Tensor) -> torch.Tensor:
    """Token-aligned values [T] of the whole micro-batch on every CP rank (differentiable)."""
    device = hidden_S1H.device
    rows_P = head_values(model, hidden_S1H).float()
    full_P = torch.zeros(lay.cu_padded[-1], dtype=rows_P.dtype, device=device).index_put((lay.local_idx.to(device),), rows_P)
    full_P = dist_nn.all_reduce(full_P, group=mpu.get_context_parallel_group())
    out_T = full_P[lay.src_T.to(device)]  # token t's value is read at the position before it
    return torch.where(lay.valid_T.to(device), out_T, torch.zeros_like(out_T))


class MegatronCritic(MegatronBackend):
    """Implements :class:`rlcore.interfaces.CriticHandle`'s per-rank side."""

    keeps_reference = False

    def _build_model(self, cfg: MegatronConfig, config: RunConfig, *, load: bool):
        if not is_value_model(self.hf_config):
            self.hf_config = value_model_config(self.hf_config)  # untied: no LM head to tie to the embedding
        model = parallel.build_model(cfg, self.hf_config, config, self.kernels, on_cpu=self.on_cpu, return_hidden_states=True)
        if mpu.is_pipeline_last_stage():
            model.output_layer = torch.nn.Identity()  # the vocabulary head is never run: no weights for it
            head = torch.nn.Linear(self.hf_config.hidden_size, 1, bias=True, dtype=model.config.params_dtype)
            with torch.no_grad():  # a fresh head is 0 (loading replaces it with the checkpoint's, if any)
                head.weight.zero_()
                head.bias.zero_()
            model.value_head = head.to(next(model.parameters()).device)
        if load:
            load_hf_into_megatron(model, self.model_path, self.hf_config)
        return model

    def _model_inputs(self, mb: MicroBatch):
        """(micro-batch for the loss, input ids [1, T], positions [1, T], PackedSeqParams, values_fn), on the device."""
        device = self._device
        if self.ranks.cp_size > 1:
            lay = context_parallel.layout(mb, self.ranks.cp_size, self.ranks.cp, self._pad_multiple())
            ids, pos, params = context_parallel.inputs(mb, lay, device)
            return mb, ids, pos, params, partial(cp_values, self.module, lay)
        on_device = mb.to(device, non_blocking=True)
        params = packed_seq_params(mb.cu_seqlens, mb.num_tokens, int(mb.max_seqlen), device)
        return (on_device, on_device.input_ids_T[None], on_device.position_ids_T[None], params,
                partial(micro_batch_values, self.module, on_device))

    # ---- rlcore.interfaces.CriticHandle, per rank --------------------------------------------
    @torch.no_grad()
    @cpu_shims.shimmed
    def values(self, batch: SequenceBatch) -> list[torch.Tensor] | None:
        """Token-aligned float32 values of every sequence on rank 0 (None on the others)."""
        return self._logprobs(batch)

    def logprobs(self, batch: SequenceBatch, *, reference: bool = False):
        raise TypeError("a critic gives values(), not logprobs()")

    @cpu_shims.shimmed
    def train(self, batch: SequenceBatch, loss) -> dict[str, float]:
        """One optimizer step per ``policy.train_global_batch_size`` sequences on ``loss`` (the value loss)."""
        return train_in_optimizer_steps(batch, self.run.policy.train_global_batch_size,
                                        lambda part: self._train_step(part, loss), "rlcore-megatron critic")

    def offload(self, *, keep_weights: bool = False) -> None:
        super().offload(keep_weights=keep_weights)
