"""LoRA on the fsdp2 backend (``policy.lora``), with ``peft``.

Adapters are injected into the Hugging Face model in place (``peft.inject_adapter_in_model``)
before parallelization, and every other parameter is frozen: FSDP2 shards the frozen base and the
trainable adapters together, and the optimizer keeps state only for parameters that get
gradients. The reference policy is the initial weights, i.e. the base model (B = 0 at init).

Refit and ``export_hf`` send *merged* weights in the base model's Hugging Face names, merged in
float32 and cast once, and ``export_hf`` also writes the adapter in PEFT's format
(:mod:`rlcore.training.lora`, shared with the Megatron backend). Sending the adapters alone to vLLM (its
LoRA support) is not implemented.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from rlcore.training.lora import merge, peft_config, write_adapter  # noqa: F401 - write_adapter: this module's export API

ADAPTER = "default"  # peft's adapter name
_PARTS = (".base_layer.weight", f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight")


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
            base, a, b = (parts[p] for p in _PARTS)
            yield f"{prefix}.weight", merge(base, a, b, scale, dtype)
    if pending:
        raise RuntimeError(f"lora merge: layers {sorted(pending)[:3]} are missing a base weight or an adapter")


def adapter_tensors(named: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's saved names (``base_model.model.<module>.lora_A.weight``)."""
    return {f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": tensor.contiguous()
            for name, tensor in named if ".lora_" in name}

