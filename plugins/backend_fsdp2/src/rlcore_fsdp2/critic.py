"""PPO's critic on the fsdp2 backend: the Hugging Face model with a value head, under FSDP2.

:class:`FSDP2Critic` is the backend (:mod:`rlcore_fsdp2.backend`) with another model and forward:
``AutoModelForTokenClassification`` with one label (:mod:`rlcore.training.value_model`) instead of the
causal LM, and a forward returning token-aligned values instead of logprobs
(:func:`rlcore.training.ops.token_aligned_values`). Everything else is the backend's: packed micro-batches
and their attention, FSDP2 over the data-parallel ranks with gradients summed, the optimizer,
scheduler, clipping and non-finite skip, DCP checkpoints, offloading, and the Hugging Face export
(a token-classification checkpoint). It trains on the value loss it is given
(:class:`rlcore.algorithms.value_loss.ValueLoss`) as the policy trains on an algorithm's loss.

Tensor parallelism is not offered here: the built-in plan splits the LM head's vocabulary, and a
one-wide head has none to split. A critic under TP runs on the Megatron backend.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore.config.schema import RunConfig
from rlcore.config.structure import ConfigError
from rlcore.interfaces import SequenceBatch, WorldInfo
from rlcore.training.ops import token_aligned_values
from rlcore.data.packing import MicroBatch
from rlcore.training.value_model import HEAD, is_value_model, value_model_config
from rlcore_fsdp2 import attention
from rlcore_fsdp2.backend import FSDP2Backend
from rlcore_fsdp2.config import SECTION, DTensorConfig


def build_critic(config: RunConfig, section_config: DTensorConfig | None, world: WorldInfo) -> FSDP2Critic:
    """Factory named by the ``fsdp2`` registration's ``critic`` capability (:mod:`rlcore.controller.critic_step`)."""
    return FSDP2Critic(config, section_config or DTensorConfig(), world)


class FSDP2Critic(FSDP2Backend):
    """Implements :class:`rlcore.interfaces.CriticHandle`'s per-rank side."""

    keeps_reference = False

    def __init__(self, config: RunConfig, cfg: DTensorConfig, world: WorldInfo, **kwargs: Any):
        if cfg.tensor_parallel_size > 1:
            raise ConfigError(f"{SECTION}.tensor_parallel_size", "the fsdp2 backend's critic runs with "
                              "tensor_parallel_size 1 (its value head has no vocabulary to split); use the Megatron backend")
        super().__init__(config, cfg, world, **kwargs)

    def _load_hf_config(self, hf_config: Any) -> Any:
        loaded = super()._load_hf_config(hf_config)
        return loaded if is_value_model(loaded) else value_model_config(loaded)

    def _build_model(self, random_init: bool, seed: int) -> torch.nn.Module:
        from transformers import AutoModelForTokenClassification

        impl = attention.register()
        if random_init:
            torch.manual_seed(seed)
            with torch.device(self.device):
                model = AutoModelForTokenClassification.from_config(self.hf_config, dtype=self.master_dtype,
                                                                    attn_implementation=impl)
            missing = {f"{HEAD}.weight"}
        else:
            model, info = AutoModelForTokenClassification.from_pretrained(
                self.policy.model_name, config=self.hf_config, dtype=self.master_dtype, attn_implementation=impl,
                output_loading_info=True)
            model.to(self.device)
            missing = set(info["missing_keys"])
        if f"{HEAD}.weight" in missing:  # a fresh head: zero, the same on every backend and rank
            with torch.no_grad():
                for param in getattr(model, HEAD).parameters():
                    param.zero_()
        model.config.use_cache = False
        return model

    def _forward_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Token-aligned values [T] of a (device) micro-batch (the critic's forward in place of logprobs)."""
        cu, max_len = attention.attention_cu_seqlens(mb.cu_seqlens, mb.num_tokens, self.device)
        out = self.model(input_ids=mb.input_ids_T[None], position_ids=mb.position_ids_T[None], use_cache=False,
                         cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        rows_T = out.logits.squeeze(0).squeeze(-1).to(self.master_dtype)
        return token_aligned_values(rows_T, mb.position_ids_T, mb.seq_index_T)

    # ---- rlcore.interfaces.CriticHandle, per rank --------------------------------------------
    def values(self, batch: SequenceBatch) -> list[torch.Tensor] | None:
        """Token-aligned float32 values of every sequence on rank 0 (None on the others)."""
        return self._logprobs(batch)

    def logprobs(self, batch: SequenceBatch, *, reference: bool = False):
        raise TypeError("a critic gives values(), not logprobs()")

    def offload(self, *, keep_weights: bool = False) -> None:
        super().offload(keep_weights=keep_weights)
