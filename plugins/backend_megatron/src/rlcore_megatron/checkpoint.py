"""Checkpoints through Megatron's ``dist_checkpointing``, and Hugging Face export.

A checkpoint directory holds:
- ``megatron/``: model and optimizer state as sharded tensors (each rank writes its shards;
  resumable under the same layout, and the model part under another TP/PP layout); with LoRA the
  adapters and their optimizer state only (the frozen base is ``policy.model_name``'s);
- ``extra/rank_<r>.pt``: per-rank scheduler state, step counter and RNG states (CPU, CUDA and
  Megatron's RNG tracker), so that a resumed run continues bit for bit.

Loading runs no code from the checkpoint: ``dist_checkpointing`` unpickles DCP's metadata and
its non-tensor items without restrictions, so those files are verified first
(:func:`rlcore.training.safe_load.verify_dcp_dir`), and every ``.pt`` file is read with ``weights_only``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from torch.distributed.checkpoint.api import CheckpointException

from rlcore.training.safe_load import DamagedCheckpointError, load_tensors, rank_failure, verify_dcp_dir
from rlcore_megatron import lora

# Fully parallel save/load with no gathering; reshardable across data-parallel sizes.
SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def _model_sharded(backend) -> dict:
    """The model's sharded state: with LoRA the adapters alone (the base is the Hugging Face checkpoint)."""
    return lora.sharded_state_dict(backend.module) if backend.lora is not None else backend.module.sharded_state_dict()


def _load_model_state(backend, state: dict) -> None:
    if backend.lora is not None:
        lora.load_state(backend.module, state)
    else:
        backend.module.load_state_dict(state)


def _sharded(backend, *, is_loading: bool) -> dict:
    model_sd = _model_sharded(backend)
    return {"model": model_sd,
            "optimizer": backend.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=SHARDING)}


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(backend, path: str) -> None:
    root = Path(path)
    rank = dist.get_rank()
    if rank == 0:
        (root / "megatron").mkdir(parents=True, exist_ok=True)
        (root / "extra").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(backend, is_loading=False), str(root / "megatron"),
                            content_metadata=SHARDING)
    extra = {"scheduler": backend.scheduler.state_dict(), "step": backend.step, "optimizer_steps": backend.step,
             "rng": _rng_state()}
    torch.save(extra, root / "extra" / f"rank_{rank}.pt")
    dist.barrier()


def _init_adam_state(optimizer) -> None:
    """Give every parameter a (zero) Adam state with a ``step``: without Apex/TE, Megatron's
    distributed optimizer reads one common step from the state even before the first update."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state.setdefault("exp_avg", torch.zeros_like(p.data))
                    state.setdefault("exp_avg_sq", torch.zeros_like(p.data))


def _set_adam_steps(optimizer, step: int) -> None:
    """Without Apex/TE, Megatron's distributed optimizer restores torch AdamW's per-parameter
    ``step`` from its template (0 before the first update) and as ONE tensor shared by every
    state (which AdamW would increment once per parameter). Set each its own count of updates."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if "step" in state:
                state["step"] = torch.tensor(float(step))


def load(backend, path: str) -> None:
    root = Path(path)
    if not (root / "megatron").is_dir():
        raise FileNotFoundError(f"{root} is not an rlcore-megatron checkpoint (no megatron/ directory)")
    _verify(root / "megatron")
    _init_adam_state(backend.optimizer)
    try:
        state = dist_checkpointing.load(_sharded(backend, is_loading=True), str(root / "megatron"))
    except (Exception, CheckpointException) as exc:
        verify_dcp_dir(root / "megatron", tensors=True)  # names the file at fault when it is one
        raise (rank_failure(exc) if isinstance(exc, CheckpointException) else exc) from None
    _load_model_state(backend, state["model"])
    with torch.no_grad():  # fp32 main params are views of the model's leaf parameters
        backend.optimizer.load_state_dict(state["optimizer"])
    extra_file = root / "extra" / f"rank_{dist.get_rank()}.pt"
    if not extra_file.is_file():
        raise FileNotFoundError(f"{extra_file} is missing: the checkpoint was written with a different world size")
    extra = load_tensors(extra_file, allow_numpy=True)
    backend.scheduler.load_state_dict(extra["scheduler"])
    backend.step = int(extra["step"])
    _set_adam_steps(backend.optimizer, extra.get("optimizer_steps", backend.step))
    _set_rng_state(extra["rng"])
    dist.barrier()


def _verify(directory: Path) -> None:
    """What ``dist_checkpointing.load`` reads, checked by loaders that run no code: the DCP
    metadata and pickled items, ``common.pt`` (weights only) and ``metadata.json``."""
    verify_dcp_dir(directory)
    if (directory / "common.pt").is_file():
        load_tensors(directory / "common.pt")
    for name in ("metadata.json",):
        if (directory / name).is_file():
            try:
                json.loads((directory / name).read_text())
            except (ValueError, UnicodeDecodeError) as exc:
                raise DamagedCheckpointError(f"{directory / name}: not JSON ({exc})") from None


def export_hf(backend, path: str, shard_bytes: int = 4 << 30) -> None:
    """A Hugging Face checkpoint (:func:`rlcore.training.weights.write_hf_checkpoint`) in the model's
    ``params_dtype``, with the tokenizer of ``policy.tokenizer_name`` (default: the model's). With
    LoRA the weights are merged, and the adapter is written in PEFT's format to ``<path>/adapter``."""
    from rlcore.training.lora import ADAPTER_DIR, write_adapter
    from rlcore.training.weights import write_hf_checkpoint

    policy = backend.run.policy
    dtype = backend.module.config.params_dtype
    write_hf_checkpoint(backend.export_weights(dtype=dtype, chunk_bytes=shard_bytes), path, backend.hf_config, dtype,
                        policy.tokenizer_name or policy.model_name, model_dir=policy.model_name, rank=dist.get_rank())
    if backend.lora is not None:
        tensors = lora.adapter_tensors(backend.module, backend.hf_config)  # a collective on every rank
        if dist.get_rank() == 0:
            write_adapter(Path(path) / ADAPTER_DIR, tensors, policy.lora, policy.model_name, lora.hf_targets(backend.lora))
    dist.barrier()


def load_model(backend, path: str) -> None:
    """Only the model part of a checkpoint written by :func:`save`, resharded by
    ``dist_checkpointing`` onto this backend's layout (``rlcore export`` reads a checkpoint of any
    TP/PP/EP layout into one process)."""
    root = Path(path)
    if not (root / "megatron").is_dir():
        raise FileNotFoundError(f"{root} is not an rlcore-megatron checkpoint (no megatron/ directory)")
    _verify(root / "megatron")
    try:
        state = dist_checkpointing.load({"model": _model_sharded(backend)}, str(root / "megatron"))
    except (Exception, CheckpointException) as exc:
        verify_dcp_dir(root / "megatron", tensors=True)
        raise (rank_failure(exc) if isinstance(exc, CheckpointException) else exc) from None
    _load_model_state(backend, state["model"])
