"""LoRA on the fsdp2 backend (``policy.lora``), with ``peft``.

Adapters are injected into the Hugging Face model in place (``peft.inject_adapter_in_model``)
before parallelization, and every other parameter is frozen: FSDP2 shards the frozen base and the
trainable adapters together, and the optimizer keeps state only for parameters that get
gradients. The reference policy is the initial weights, i.e. the base model (B = 0 at init).

Refit and ``export_hf`` send *merged* weights in the base model's Hugging Face names::

    W' = W + (alpha / r) * B @ A          computed in float32, then cast to the export dtype

Merging in bf16 rounds away small updates (the product lands below W's bf16 resolution:
NeMo-RL#3696); merging in fp32 first keeps them until the one final cast. ``export_hf`` also
writes the adapter in PEFT's format (``<path>/adapter``: ``adapter_config.json`` +
``adapter_model.safetensors``), loadable with ``peft.PeftModel.from_pretrained``. Sending the
adapters alone to vLLM (its LoRA support) is not implemented.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"  # peft's adapter name
_PARTS = (".base_layer.weight", f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight")


def peft_config(cfg: Any):
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
    """Inject adapters into ``model`` in place and freeze everything else; returns ``model``."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"policy.lora.target_modules={list(cfg.target_modules)}: {err}") from err
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    return model


def merged(named: Iterator[tuple[str, torch.Tensor]], scale: float, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs with each adapted layer merged (float32), cast to ``dtype``.

    ``named`` yields full float32 tensors in ``named_parameters`` order: a layer's base weight, then
    its ``lora_A`` and ``lora_B``, which are held until all three have arrived."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        part = next((p for p in _PARTS if name.endswith(p)), None)
        if part is None:
            yield name.replace(".base_layer.", "."), tensor.to(dtype)
            continue
        prefix = name[: -len(part)]
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == len(_PARTS):
            del pending[prefix]
            base, a, b = (parts[p].float() for p in _PARTS)
            yield f"{prefix}.weight", (base + scale * (b @ a)).to(dtype)
    if pending:
        raise RuntimeError(f"lora merge: layers {sorted(pending)[:3]} are missing a base weight or an adapter")


def adapter_tensors(named: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's saved names (``base_model.model.<module>.lora_A.weight``)."""
    return {f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": tensor.contiguous()
            for name, tensor in named if ".lora_" in name}


def write_adapter(path: str | Path, tensors: dict[str, torch.Tensor], cfg: Any, base_model: str) -> None:
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(cfg)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(out))
    save_file({k: v.cpu() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
