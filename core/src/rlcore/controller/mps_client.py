"""``experimental.trainer_mps_priority``: the trainer's CUDA context as a client of an MPS daemon, at a priority.

One step off on one GPU keeps a vLLM engine resident beside the trainer; without MPS the two processes'
kernels are time-sliced, under MPS they run side by side. MPS reads a client's priority
(``CUDA_MPS_CLIENT_PRIORITY``: 0 normal, 1 below normal) once, when the process creates its CUDA context,
so the context is created here with the variable set, and the variable removed again at once: the
engine core vLLM starts later inherits this process's environment and keeps normal priority. With the
trainer below normal and its GEMMs leaving half the SMs (``policy.megatron_cfg.experimental.gemm_sm_margin``), a
1.2B engine kept about its own speed on half a GPU beside the trainer.

The MPS daemon is the user's to start (``nvidia-cuda-mps-control -d``): it is a user-space process,
not a setting of the card. Without one CUDA ignores the variable, so its absence is an error here. An
SM cap (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) is not offered: under one, the trainer's losses came out
non-finite (60% of the SMs) and its logprobs wrong (70%).
"""

from __future__ import annotations

import os
from pathlib import Path

from rlcore.config import ConfigError
from rlcore.interfaces import Placement

KEY = "experimental.trainer_mps_priority"
PRIORITIES = {"normal": "0", "below_normal": "1"}
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # nvidia-cuda-mps-control's, when CUDA_MPS_PIPE_DIRECTORY is unset
_entered: str | None = None  # the priority this process's context was created at here (a second run may follow)


def mps_control_pipe(environ: dict[str, str] | None = None) -> Path:
    """Where a running MPS daemon's control pipe lies for a process with ``environ``."""
    environ = os.environ if environ is None else environ
    return Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY) / "control"


def enter_mps_client(priority: str | None, placement: Placement) -> None:
    """Create this process's CUDA context under the MPS daemon at ``priority`` (None: leave CUDA alone).

    Called before the trainer is built in this process, so that its context is the first (a later run in the
    same process at the same priority finds it so); raises :class:`ConfigError` naming
    ``experimental.trainer_mps_priority`` where that cannot hold.
    """
    if priority is None:
        return
    if priority not in PRIORITIES:
        raise ConfigError(KEY, f"{priority!r} is not one of {sorted(PRIORITIES)}")
    if placement.device != "cuda":
        raise ConfigError(KEY, "is a CUDA setting: this run has no GPU (cluster.gpus_per_node is 0)")
    if placement.use_ray:
        raise ConfigError(KEY, "applies to a trainer in the driver's process (one GPU, cluster.use_ray false); "
                               "this run's trainer ranks are Ray workers")
    pipe = mps_control_pipe()
    if not pipe.exists():
        raise ConfigError(KEY, f"no MPS daemon: its control pipe {pipe} does not exist. Start one with "
                               "`nvidia-cuda-mps-control -d` (the same CUDA_MPS_PIPE_DIRECTORY as this process), "
                               "or leave the key unset")
    import torch

    global _entered
    if torch.cuda.is_initialized():
        if _entered == priority:
            return
        raise ConfigError(KEY, "this process's CUDA context exists already, and MPS reads a client's priority only "
                               "when its context is created: set the key before anything in the process uses CUDA")
    create_context_with({"CUDA_MPS_CLIENT_PRIORITY": PRIORITIES[priority]})
    _entered = priority
    print(f"{KEY}: this process's CUDA context is an MPS client at {priority} priority", flush=True)


def create_context_with(variables: dict[str, str]) -> None:
    """Create this process's CUDA context with the MPS ``variables`` in its environment, removed again
    after, so that the processes it starts later (vLLM's engine core) do not inherit them."""
    import torch

    os.environ.update(variables)
    try:
        torch.zeros(1, device="cuda")
    finally:
        for name in variables:
            del os.environ[name]
