"""A scalar head on a causal LM, loaded and run through ``transformers``.

``AutoModelForSequenceClassification`` with one label reads a causal-LM checkpoint's body and adds
a linear ``score`` head on the hidden state of each sequence's last non-padding token (a fresh head
when the checkpoint is a plain causal LM, the trained one when it is a reward model). Sequences are
right-padded with the model's ``pad_token_id``, which the pooling relies on.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore.utils import torch_dtype


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class RewardScorer:
    """``scores(sequences) -> [N]`` floats; ``model`` is the ``torch.nn.Module`` being trained or used."""

    def __init__(self, path: str, device: str = "auto", dtype: str = "float32", pad_token_id: int | None = None):
        from transformers import AutoConfig, AutoModelForSequenceClassification

        self.device = pick_device(device)
        config = AutoConfig.from_pretrained(path)
        config.num_labels = 1
        if config.pad_token_id is None:
            if pad_token_id is None:
                raise ValueError(f"reward model {path}: its config has no pad_token_id and none was given; the "
                                 "last-token pooling needs one")
            config.pad_token_id = pad_token_id
        self.pad_token_id = int(config.pad_token_id)
        self.model: Any = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=torch_dtype(dtype))
        self.model.to(self.device)

    def scores(self, sequences: list[list[int]]) -> torch.Tensor:
        """One score per sequence [N] (float32, on the scorer's device); differentiable when grads are on."""
        longest = max(len(s) for s in sequences)
        ids_NL = torch.full((len(sequences), longest), self.pad_token_id, dtype=torch.long)
        mask_NL = torch.zeros((len(sequences), longest), dtype=torch.long)
        for i, seq in enumerate(sequences):
            ids_NL[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask_NL[i, : len(seq)] = 1
        if (ids_NL[mask_NL.bool()] == self.pad_token_id).any():
            raise ValueError(f"a scored sequence contains the pad token id {self.pad_token_id}; the last-token "
                             "pooling would stop there")
        out = self.model(input_ids=ids_NL.to(self.device), attention_mask=mask_NL.to(self.device))
        return out.logits[:, 0].float()
