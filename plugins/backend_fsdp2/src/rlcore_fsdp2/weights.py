"""Moving the sharded weights around: export for refit and to Hugging Face safetensors, the frozen
reference policy swapped in from CPU, and offloading of accelerator memory.

Everything works on the *local shards* of FSDP2/DTensor parameters, so no rank ever holds the
full model more than one tensor at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from torch import nn
from torch.distributed.tensor import DTensor

from rlcore_fsdp2.parallelize import hf_name


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard (a view sharing storage with the parameter)."""
    return t._local_tensor if isinstance(t, DTensor) else t.data


def gather_full(param: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """All-gather one parameter (cast first: half the traffic in bf16). A collective on every rank."""
    if not isinstance(param, DTensor):
        return param.detach().to(device=device, dtype=dtype)
    if param.device_mesh.size() == 1:
        # One rank's shard is the whole tensor: DTensor's redistribute would cost ~0.5 ms of host
        # time per parameter for nothing (a third of a tiny model's refit on CPU).
        return param._local_tensor.detach().to(device=device, dtype=dtype)
    shard = DTensor.from_local(param._local_tensor.detach().to(device=device, dtype=dtype), param.device_mesh,
                               param.placements, shape=param.shape, stride=param.stride(), run_check=False)
    return shard.full_tensor()


def iter_hf_tensors(model: nn.Module, dtype: torch.dtype, device: torch.device, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face checkpoint name, full tensor) for every parameter; yields on rank 0 only.

    transformers' reverse weight conversion maps in-memory layouts back to checkpoint names
    (e.g. Qwen3-MoE's fused ``experts.gate_up_proj`` to per-expert ``gate_proj``/``up_proj``),
    which is what vLLM and ``from_pretrained`` load.
    """
    from transformers.core_model_loading import revert_weight_conversion

    for name, param in model.named_parameters():
        full = gather_full(param, dtype, device)
        if rank == 0:
            yield from revert_weight_conversion(model, {hf_name(name): full}).items()
        del full


class ReferencePolicy:
    """The initial weights' local shards, in CPU memory (pinned on CUDA), swapped into the
    live parameters for reference logprobs: no second model copy on the accelerator."""

    def __init__(self, params: list[torch.Tensor]):
        pin = torch.cuda.is_available() and any(local(p).is_cuda for p in params)
        self.params = params
        self.shards = [self._to_cpu(local(p), pin) for p in params]

    @staticmethod
    def _to_cpu(t: torch.Tensor, pin: bool) -> torch.Tensor:
        copy = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        copy.copy_(t.detach())
        return copy

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        current = []
        for p, ref in zip(self.params, self.shards):
            shard = local(p)
            current.append(self._to_cpu(shard, ref.is_pinned()))
            shard.copy_(ref, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, cur in zip(self.params, current):
                    local(p).copy_(cur, non_blocking=True)


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, weights: bool = True) -> Iterator[torch.Tensor]:
    """The rank's training state for :class:`rlcore.training.steps.HostOffloader`: the local shards of the
    parameters (unless ``weights`` is false), their gradients, and the optimizer's state."""
    for p in model.parameters():
        if weights:
            yield local(p)
        if p.grad is not None:
            yield local(p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield local(value)
