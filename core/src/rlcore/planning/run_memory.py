"""One run's memory plan, made before anything loads: what each phase holds on the busiest GPU, and the
two decisions it sets when the recipe leaves them ``auto``.

The numbers are :func:`rlcore.planning.memory.estimate`'s (the model ``rlcore plan`` uses) for the run's own
layout, batch and lengths on the GPU this process sees:

- ``policy.generation.gpu_memory_utilization: auto``: a colocated engine gets its weights, its overhead and
  twice the KV cache a step's sequences need at once, within what the trainer leaves free while the engine is
  awake (its kept state, the refit's staged chunk and probe pass, collective buffers and the CUDA context)
  less the calibration's headroom, and at most 0.9 of the GPU; an engine on GPUs of its own gets 0.9.
- ``policy.generation.colocated.offload_trainer_state: auto``: the trainer's gradients and optimizer state
  go to host memory while the engine is awake when, kept, they would leave the engine less KV cache than a
  step's sequences need at once (or none), and the synchronous loop runs (the async loop trains while the
  engine generates, so its state stays).

A plan that cannot fit even so is refused here (:class:`PlanRefused`), naming the phase, its largest part
and the key that would make it fit. On CPU only the training phase is checked, against host memory shared
by the local ranks (vLLM's CPU engine sizes its KV cache from its own key).
"""

from __future__ import annotations

import attrs
from attrs import frozen

from rlcore.config import ConfigError, RunConfig
from rlcore.planning import plan as planning
from rlcore.planning.calibration import load_calibration
from rlcore.loading.loader import to_dict
from rlcore.planning.hardware import GPU, Cluster
from rlcore.planning.layout import Layout, Workload
from rlcore.planning.memory import ENGINE_CAP, Memory, estimate
from rlcore.planning.shapes import ModelShape

AUTO = "auto"

# (phase, largest part, backend) -> (the key that shrinks it, how); "*" = any
_FIX = {
    ("training", "activations", "*"): ("policy.sequence_packing.train_mb_tokens", "fewer tokens a micro-batch, or activation checkpointing"),
    ("training", "logits", "*"): ("policy.sequence_packing.train_mb_tokens", "fewer tokens a micro-batch"),
    ("training", "*", "megatron"): ("policy.megatron_cfg.tensor_model_parallel_size", "split the model over more GPUs (cluster.gpus_per_node)"),
    ("training", "*", "fsdp2"): ("cluster.gpus_per_node", "more GPUs to shard the state over, or policy.dtensor_cfg.cpu_offload"),
}


class PlanRefused(ConfigError):
    """The run cannot fit the GPU it would run on; raised before any model loads."""


@frozen
class RunMemoryPlan:
    memory: Memory
    gpu: GPU
    engine_fraction: float | None  # the engine's share of a GPU (None: no engine on this GPU, or CPU)
    offload_trainer_state: bool  # the trainer's state leaves the GPU while a colocated engine is awake
    decided: tuple[str, ...]  # the keys this plan set (those the recipe left auto)

    def metrics(self) -> dict[str, float]:
        """The prediction, per phase, as record keys (beside the measured ``memory/<phase>_device_gib``)."""
        m = self.memory
        out = {"memory_plan/training_gib": sum(m.train_parts.values())}
        if m.gen_parts:
            out["memory_plan/generation_gib"] = sum(m.gen_parts.values())
            out["memory_plan/engine_fraction"] = float(self.engine_fraction or 0.0)
        out["memory_plan/offload_trainer_state"] = float(self.offload_trainer_state)
        return out

    def line(self) -> str:
        """The console line: what was chosen and why."""
        m, gib = self.memory, self.gpu.memory_gib
        train_largest = max(m.train_parts, key=m.train_parts.get)
        text = (f"memory plan ({self.gpu.name}, {gib:.0f} GiB): training {sum(m.train_parts.values()):.1f} GiB "
                f"(largest: {train_largest} {m.train_parts[train_largest]:.1f})")
        if self.engine_fraction is not None and m.gen_parts:
            kept = sum(v for k, v in m.gen_parts.items() if not k.startswith(("engine", "kv_cache")))
            text += (f"; generation: trainer keeps {kept:.1f} GiB"
                     + (" (its gradients and optimizer state in host memory)" if self.offload_trainer_state else "")
                     + f", engine {self.engine_fraction:.2f} x {gib:.0f} GiB (KV cache {m.engine_kv_gib:.1f} GiB; "
                     f"the step's sequences need {m.kv_need_gib:.1f})")
        if self.decided:
            text += f"; set: {', '.join(self.decided)}"
        return text


def with_refit(work: Workload, config: RunConfig, probe_sequence_tokens: int) -> Workload:
    """``work`` with the refit's part of the engine-awake phase: the staged chunk, and the probe's sequences at
    ``probe_sequence_tokens`` each (a run plans them at the length limit: the probe takes the step's first
    sequences, which may fill it)."""
    refit = config.generation.refit
    return attrs.evolve(work, refit_chunk_bytes=refit.chunk_bytes, probe_tokens=refit.probe_num_sequences * probe_sequence_tokens)


def plan_run_memory(config: RunConfig, shape: ModelShape, gpu: GPU, world: int, *, critic: bool, cpu: bool = False) -> RunMemoryPlan:
    """The plan for ``world`` trainer ranks on ``gpu`` (on CPU: host memory a rank); raises :class:`PlanRefused`.

    The one place the plan reads the run's config: the recipe's layout and workload
    (:func:`rlcore.planning.plan.recipe_work`), the refit's staged chunk and probe, and the keys it decides;
    the estimates take those typed values."""
    gen = config.generation
    fraction_key, offload_key = gen.gpu_memory_utilization, gen.colocated.offload_trainer_state
    releasable = gen.colocated.enabled and not config.grpo.async_grpo.enabled  # a colocated engine, the synchronous loop
    tree = to_dict(config)
    layout, work = planning.recipe_work(config, tree)
    if config.policy.lora.enabled:
        work = attrs.evolve(work, lora_params=shape.lora_params(config.policy.lora.rank, config.policy.lora.target_modules))
    work = with_refit(attrs.evolve(work, critic=critic, generation=work.generation and not cpu), config,
                      config.policy.max_total_sequence_length)
    # the calibration of the GPU the run is on (the shipped H200 one for a GPU without its own)
    cal, cluster = load_calibration(gpu.name), Cluster(gpu, 1, world + layout.gen_gpus)
    release = offload_key is True
    kept_layout, released_layout = layout.with_release(release), layout.with_release(True)
    mem = estimate(shape, work, kept_layout, cluster, cal)
    if offload_key == AUTO and not cpu and releasable:
        released = estimate(shape, work, released_layout, cluster, cal)
        if mem.better_released(released):
            mem, release = released, True
    decided = [f"offload_trainer_state={str(release).lower()}"] if offload_key == AUTO and not cpu else []
    engine_fraction = None
    if work.generation:
        if fraction_key == AUTO:
            engine_fraction = round(mem.engine_fraction if gen.colocated.enabled else ENGINE_CAP, 3)
            decided.append(f"gpu_memory_utilization={engine_fraction:.2f}")
        else:
            engine_fraction = float(fraction_key)
    if not mem.fits:
        key, how = _key_for(mem, kept_layout, releasable)
        raise PlanRefused(key, f"the run does not fit one {gpu.name} ({gpu.memory_gib:.0f} GiB): {mem.problem}; "
                               f"to fit: {how} (`rlcore plan` shows every part)")
    return RunMemoryPlan(mem, gpu, engine_fraction, release, tuple(decided))


def _key_for(mem: Memory, lay: Layout, releasable: bool) -> tuple[str, str]:
    """The key that would make the refused phase fit, and how."""
    problem = mem.problem or ""
    if problem.startswith("generation"):
        if "gpu_memory_utilization" in problem:
            return "policy.generation.gpu_memory_utilization", "auto (the engine is sized within what the trainer leaves free)"
        if not lay.releases_state and releasable:
            return ("policy.generation.colocated.offload_trainer_state",
                    "true or auto (the trainer's gradients and optimizer state leave while the engine is awake)")
        return ("policy.generation.colocated.enabled", "false (the engine on GPUs of its own), or a shorter "
                "policy.max_total_sequence_length")
    largest = max(mem.train_parts, key=mem.train_parts.get)
    return _FIX.get(("training", largest, "*")) or _FIX[("training", "*", lay.backend)]
