"""A frozen teacher model that scores sequences: token-aligned logprobs for on-policy distillation.

Loaded with ``transformers`` in the driver process (on the GPU when there is one); sequences are
right-padded into batches, so every real token sees only the tokens before it.
"""

from __future__ import annotations

import torch

from rlcore.interfaces import SequenceBatch
from rlcore.utils import torch_dtype


class HFTeacher:
    """``logprobs(batch)``: token-aligned float32 logprobs [L_i] of each sequence (CPU), index 0 = 0."""

    def __init__(self, path: str, device: str = "auto", dtype: str = "float32", batch_size: int = 32):
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype)).to(self.device).eval()
        self.batch_size = batch_size
        self.path = path

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch) -> list[torch.Tensor]:
        vocab = self.model.config.vocab_size
        out: list[torch.Tensor] = []
        for start in range(0, len(batch), self.batch_size):
            seqs = batch.input_ids[start : start + self.batch_size]
            longest = max(int(s.numel()) for s in seqs)
            ids_BL = torch.zeros((len(seqs), longest), dtype=torch.long)
            mask_BL = torch.zeros((len(seqs), longest), dtype=torch.long)
            for i, seq in enumerate(seqs):
                if int(seq.max()) >= vocab:
                    raise ValueError(f"teacher {self.path}: token id {int(seq.max())} of sequence {start + i} is outside "
                                     f"its vocabulary of {vocab}; the teacher must share the policy's tokenizer")
                ids_BL[i, : seq.numel()], mask_BL[i, : seq.numel()] = seq, 1
            logits_BLV = self.model(input_ids=ids_BL.to(self.device), attention_mask=mask_BL.to(self.device)).logits
            next_BL = torch.log_softmax(logits_BLV[:, :-1].float(), dim=-1).gather(
                -1, ids_BL[:, 1:, None].to(self.device)).squeeze(-1).cpu()
            for i, seq in enumerate(seqs):
                out.append(torch.cat([torch.zeros(1), next_BL[i, : seq.numel() - 1]]))
        return out


def build_teacher(config) -> HFTeacher:
    """The teacher of a :class:`rlcore.algorithms.config.DistillationConfig`."""
    from pathlib import Path

    from rlcore.config import ConfigError

    if not config.teacher_model:
        raise ConfigError("algorithm.teacher_model", "distillation needs a teacher: set it to a local Hugging Face "
                          "model directory that shares the policy's tokenizer")
    if not (Path(config.teacher_model).expanduser() / "config.json").is_file():
        raise ConfigError("algorithm.teacher_model", f"{config.teacher_model!r} is not a local Hugging Face model "
                          "directory (no config.json)")
    return HFTeacher(config.teacher_model, config.teacher_device, config.teacher_dtype, config.teacher_batch_size)
