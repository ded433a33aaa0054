"""What both training backends share for LoRA (``policy.lora``): the fp32 merge and PEFT's adapter format.

Refit and export send merged weights in the base model's Hugging Face names::

    W' = W + (alpha / r) * B @ A          computed in float32, then cast once to the export dtype

Merging in bf16 rounds away small updates (the product lands below W's bf16 resolution:
NeMo-RL#3696). ``export_hf`` also writes the adapter in PEFT's format (``<path>/adapter``:
``adapter_config.json`` + ``adapter_model.safetensors`` with tensors named
``base_model.model.<module>.lora_A.weight``), loadable with ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ADAPTER_DIR = "adapter"  # export_hf's subdirectory for the PEFT adapter


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``weight + scale * b @ a`` in float32, cast once to ``dtype``."""
    return (weight.float() + scale * (b.float() @ a.float())).to(dtype)


def peft_config(cfg: Any, target_modules: Sequence[str] | None = None):
    """PEFT's ``LoraConfig`` for ``policy.lora`` (``target_modules``: Hugging Face module names, default the config's)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(target_modules or cfg.target_modules), bias="none", task_type="CAUSAL_LM")


def peft_name(module: str, part: str) -> str:
    """PEFT's saved name of adapter ``part`` ('lora_A' or 'lora_B') of Hugging Face module ``module``."""
    return f"base_model.model.{module}.{part}.weight"


def write_adapter(path: str | Path, tensors: dict[str, torch.Tensor], cfg: Any, base_model: str,
                  target_modules: Sequence[str] | None = None) -> None:
    """A PEFT adapter directory: ``tensors`` under PEFT's saved names (:func:`peft_name`)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(cfg, target_modules)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(out))
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
