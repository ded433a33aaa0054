"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, scheduler
and each rank's RNG state, resuming exactly.

Every rank writes its own shards; DCP's metadata records every tensor's global shape, which is
checked against the live model before loading so that a checkpoint of another model fails with
a message naming the first differing parameter rather than a deep DCP error. Loading runs no code
from the checkpoint: the metadata and the non-tensor items are read by :mod:`rlcore.training.safe_load`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlcore.training.safe_load import DamagedCheckpointError, SafeFileSystemReader, SafeLoadPlanner, rank_failure, read_dcp_metadata

META_FILE = "rlcore_fsdp2.json"


def describe_model(hf_config: Any) -> dict[str, Any]:
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "num_experts")
    return {k: getattr(hf_config, k) for k in keys if getattr(hf_config, k, None) is not None}


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _trainer_state(scheduler: Any, step: int) -> dict[str, Any]:
    # Non-tensor values go through DCP as pickled bytes; JSON keeps the scheduler portable.
    return {"scheduler": json.dumps(scheduler.state_dict()), "step": step}


def save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int,
         hf_config: Any, device: torch.device) -> None:
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "trainer": _trainer_state(scheduler, step),
             f"rng_rank{dist.get_rank()}": _rng_state(device)}
    dcp.save(state, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        (path / META_FILE).write_text(json.dumps({"model": describe_model(hf_config)}, indent=2))
    dist.barrier()


def check_compatible(path: Path, model_sd: dict[str, Any], hf_config: Any) -> dict[str, Any]:
    """Raise ValueError naming the first parameter whose presence or shape differs; returns
    the checkpoint's metadata by key."""
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"{path} is not a torch.distributed.checkpoint directory (no .metadata file)")
    saved = read_dcp_metadata(path).state_dict_metadata
    meta_file = path / META_FILE
    try:
        theirs = json.loads(meta_file.read_text())["model"] if meta_file.exists() else "unknown"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise DamagedCheckpointError(f"{meta_file}: not the JSON rlcore-fsdp2 writes ({exc})") from None
    ours = describe_model(hf_config)
    where = f"checkpoint {path} was saved from a different model ({theirs}) than the one being trained ({ours})"
    for name, tensor in model_sd.items():
        key = f"model.{name}"
        if key not in saved:
            raise ValueError(f"{where}: it has no parameter '{name}'")
        saved_shape = tuple(getattr(saved[key], "size", ()))
        if saved_shape != tuple(tensor.shape):
            raise ValueError(f"{where}: parameter '{name}' has shape {list(saved_shape)} there but {list(tensor.shape)} here")
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k[len("model."):] not in model_sd)
    if extra:
        raise ValueError(f"{where}: it has parameters this model lacks, e.g. '{extra[0]}' ({len(extra)} in all)")
    return saved


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
         hf_config: Any, device: torch.device) -> int:
    """Restore everything saved by :func:`save`; returns the optimizer step count."""
    path = Path(path)
    # get_state_dict initializes the optimizer state (a zero-lr step) so DCP has tensors to load into.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = check_compatible(path, model_sd, hf_config)
    state = {"model": model_sd, "optim": optim_sd, "trainer": _trainer_state(scheduler, 0)}
    rng_key = f"rng_rank{dist.get_rank()}"
    rng = {k: v for k, v in _rng_state(device).items() if f"{rng_key}.{k}" in saved}
    if rng:  # absent when resuming on more ranks (or another device type) than were saved
        state[rng_key] = rng
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    except CheckpointException as exc:
        raise rank_failure(exc) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(json.loads(state["trainer"]["scheduler"]))
    if "cpu" in rng:
        torch.set_rng_state(state[rng_key]["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(state[rng_key]["cuda"], device)
    return int(state["trainer"]["step"])


def load_model(path: str | Path, model: nn.Module, hf_config: Any) -> None:
    """Only the model part of a checkpoint written by :func:`save`, resharded by DCP onto this
    world (``rlcore export`` reads a checkpoint of any FSDP/TP layout into one process)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(path)
    model_sd = get_model_state_dict(model)
    check_compatible(path, model_sd, hf_config)
    state = {"model": model_sd}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    except CheckpointException as exc:
        raise rank_failure(exc) from None
    set_model_state_dict(model, state["model"])
