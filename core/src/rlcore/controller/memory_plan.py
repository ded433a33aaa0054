"""The run's memory plan applied before the trainer or the engine loads (:mod:`rlcore.planning.run_memory`).

It refuses a run that cannot fit (the phase, its largest part, the key that would make it fit), and
hands the decisions of the keys a recipe leaves ``auto`` to both sides through the
:class:`~rlcore.interfaces.Placement` they are built with. Runs given a backend or a generator object
are not planned (their memory is theirs), nor are models whose shape the planner cannot read (a line
says so; the engine then takes the generator's default share), nor GPU runs whose engine has GPUs of
its own (it takes 0.9 of them, without this process starting CUDA first).
"""

from __future__ import annotations

import attrs

from rlcore.config import ConfigError, RunConfig
from rlcore.interfaces import Placement
from rlcore.planning.memory import ENGINE_CAP
from rlcore.planning.run_memory import RunMemoryPlan, plan_run_memory
from rlcore.planning.runtime import device_gpu
from rlcore.planning.shapes import resolve_shape


def apply_memory_plan(config: RunConfig, placement: Placement, *, critic: bool, given: dict) -> tuple[Placement, RunMemoryPlan | None]:
    """``placement`` with the plan's decisions, and the plan (None where none was made); raises
    :class:`~rlcore.planning.run_memory.PlanRefused`."""
    if given.get("backend") is not None or given.get("generator") is not None:
        return placement, None
    try:
        shape = resolve_shape(str(config.policy.model_name))
    except ConfigError as exc:
        if placement.device == "cuda":
            print(f"memory plan: none ({exc.message})", flush=True)
        return placement, None
    cpu = placement.device == "cpu"
    if not cpu and not placement.colocated:
        # The engine has GPUs of its own, and this process must not start CUDA before it picks them
        # (placement.driver_gpu_ids): it gets vLLM's own default share; the trainer's ranks size themselves.
        print(f"memory plan: the engine has GPUs of its own; gpu_memory_utilization={ENGINE_CAP:.2f}", flush=True)
        return attrs.evolve(placement, engine_memory_fraction=ENGINE_CAP), None
    gpu = device_gpu(placement.device)
    if cpu:  # the host's memory, shared by the trainer's local processes
        gpu = attrs.evolve(gpu, memory_gib=gpu.memory_gib / max(placement.trainer_ranks, 1))
    plan = plan_run_memory(config, shape, gpu, placement.trainer_ranks, critic=critic, cpu=cpu)
    if cpu:  # checked only: no engine memory to size, nothing to report beside the run's records
        return placement, None
    print(plan.line(), flush=True)
    return attrs.evolve(placement, engine_memory_fraction=plan.engine_fraction,
                        offload_trainer_state=plan.offload_trainer_state), plan
