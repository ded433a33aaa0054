"""The Hugging Face shape of a critic: a ``*ForTokenClassification`` model with one label.

transformers' token-classification head is a linear layer ``score`` on every position's final
hidden state; with one label it is a value head, and the checkpoint it writes loads back with
``AutoModelForTokenClassification`` (and into the fsdp2 and Megatron critics: ``score.weight``,
``score.bias``). A critic started from a causal LM gets this config and a fresh head, zero-
initialized: every backend and rank starts from the same values (0), and the body's gradient is 0
until the head has moved, so the first updates fit the head to the returns.
"""

from __future__ import annotations

import copy
from typing import Any

HEAD = "score"  # transformers' name of the token-classification head


def value_model_config(hf_config: Any) -> Any:
    """A copy of ``hf_config`` for a one-label token-classification model: no dropout on the head,
    untied embeddings (there is no LM head to tie), architectures renamed ``*ForTokenClassification``."""
    config = copy.deepcopy(hf_config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.tie_word_embeddings = False
    names = list(getattr(config, "architectures", None) or [])
    config.architectures = [n.replace("ForCausalLM", "ForTokenClassification") for n in names] or None
    return config


def is_value_model(hf_config: Any) -> bool:
    """Whether a checkpoint's config already is a one-label token-classification model (its head is kept)."""
    names = getattr(hf_config, "architectures", None) or []
    return any(n.endswith("ForTokenClassification") for n in names) and getattr(hf_config, "num_labels", None) == 1
