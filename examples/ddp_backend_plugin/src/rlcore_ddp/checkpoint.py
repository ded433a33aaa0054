"""Checkpoints of the ``ddp`` backend: safetensors and JSON only, so loading runs no code.

Every rank holds the same model and optimizer state, so rank 0 writes and every rank reads:

- ``model.safetensors``: the master weights, by parameter name;
- ``optimizer.safetensors``: AdamW's per-parameter state (``<param index>.<key>``) and the RNG state;
- ``trainer.json``: the optimizer's param groups, the scheduler's state and the step count.

A file that is not what this module wrote (truncated, or replaced by anything else) fails to load
with an error naming it; a checkpoint of another model fails naming the first differing parameter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE = "model.safetensors", "optimizer.safetensors", "trainer.json"


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read as what the ddp backend writes."""


def save(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int) -> None:
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().cpu().contiguous() for n, p in model.named_parameters()}, str(path / MODEL_FILE))
        state = optimizer.state_dict()
        tensors = {f"{index}.{key}": value.detach().cpu().contiguous()
                   for index, values in state["state"].items() for key, value in values.items()}
        tensors["rng.cpu"] = torch.get_rng_state()
        save_file(tensors, str(path / OPTIMIZER_FILE))
        trainer = {"step": step, "param_groups": state["param_groups"], "scheduler": scheduler.state_dict()}
        (path / TRAINER_FILE).write_text(json.dumps(trainer, indent=2))
    dist.barrier()


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except Exception as exc:  # noqa: BLE001 - any failure means "not a file we wrote"
        raise CheckpointFileError(f"{file}: not a safetensors file written by the ddp backend ({exc})") from None


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise CheckpointFileError(f"{file}: not the JSON the ddp backend writes ({exc})") from None


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """Restore what :func:`save` wrote into the live objects; returns the step count."""
    path = Path(path)
    weights = _read_tensors(path / MODEL_FILE)
    optim_tensors = _read_tensors(path / OPTIMIZER_FILE)
    trainer = _read_json(path / TRAINER_FILE)
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name not in weights:
            raise ValueError(f"checkpoint {path} is of another model: it has no parameter '{name}'")
        if weights[name].shape != param.shape:
            raise ValueError(f"checkpoint {path} is of another model: '{name}' has shape {list(weights[name].shape)} "
                             f"there but {list(param.shape)} here")
    extra = sorted(set(weights) - set(params))
    if extra:
        raise ValueError(f"checkpoint {path} is of another model: it has parameters this one lacks, e.g. '{extra[0]}'")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])
    rng = optim_tensors.pop("rng.cpu", None)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in optim_tensors.items():
        index, _, field = key.partition(".")
        state.setdefault(int(index), {})[field] = value
    optimizer.load_state_dict({"state": state, "param_groups": trainer["param_groups"]})
    scheduler.load_state_dict(trainer["scheduler"])
    if rng is not None:
        torch.set_rng_state(rng)
    return int(trainer["step"])
