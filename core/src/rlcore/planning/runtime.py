"""``layout: auto`` at run time: the planner's choice for the world a backend is built in.

A backend calls :func:`choose` once, on every rank, before it creates its process groups: the search is
arithmetic on the config, so every rank reaches the same answer. The keys the section sets, the
micro-batch budgets and the generation layout (placement, engine size, and the engine's share of a GPU,
``gpu_memory_utilization``, beside the trainer) are the recipe's; the backend's parallel sizes, sequence
parallelism, recompute and offload are searched. On CPU the engines' memory is not planned (vLLM's CPU
backend sizes its own KV cache in host memory).
"""

from __future__ import annotations

import os

import attrs

from rlcore.config import ConfigError, RunConfig
from rlcore.planning import plan as planning
from rlcore.planning.hardware import GPU, GPUS, Cluster
from rlcore.planning.search import Estimate
from rlcore.planning.shapes import from_hf_config

CPU = GPU("cpu", 0.0, 0.2, 0.02, 5.0, 5.0, 5.0)  # a CPU rank: shared memory for links; memory is filled in


def device_gpu(device: str) -> GPU:
    """The table's entry for this process's accelerator (by CUDA's device name), or one built from what
    CUDA reports; on CPU the host's memory shared by ``local`` ranks is each rank's memory."""
    if device == "cpu":
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return attrs.evolve(CPU, memory_gib=pages / 2**30)
    import torch

    name = torch.cuda.get_device_name().lower()
    for key, entry in GPUS.items():
        if key in name:
            return entry
    total = torch.cuda.mem_get_info()[1] / 2**30
    return attrs.evolve(GPUS["h100"], name=name, memory_gib=total)


def choose(config: RunConfig, hf_config: dict, world_size: int, device: str, *, local_ranks: int | None = None) -> tuple[Estimate, Estimate | None]:
    """(best, runner-up) fitting layouts of the recipe's backend for ``world_size`` trainer ranks."""
    gen = config.generation
    colocated = gen.colocated.enabled
    gen_gpus = 0 if colocated else gen.colocated.resources.gpus_per_node * gen.colocated.resources.num_nodes
    gpu = device_gpu(device)
    if device == "cpu":
        gpu = attrs.evolve(gpu, memory_gib=gpu.memory_gib / max(local_ranks or world_size, 1))
    nodes = max(1, config.cluster.num_nodes)
    total = world_size + gen_gpus
    shape = from_hf_config(os.path.basename(str(config.policy.model_name)), hf_config)
    inp = planning.inputs(config, world=total, gpu_name="h200", model=shape)
    cluster = Cluster(gpu, nodes if total % nodes == 0 else 1, total // (nodes if total % nodes == 0 else 1))
    work = inp.work if device != "cpu" else attrs.evolve(inp.work, generation=False)
    rec = inp.recipe_layout
    fixed = {**inp.fixed, "train_mb_tokens": rec.train_mb_tokens, "logprob_mb_tokens": rec.logprob_mb_tokens,
             "colocated": colocated, "gen_tp": rec.gen_tp, "vpp": 1, "gen_memory_fraction": rec.gen_memory_fraction}
    if not colocated:
        fixed["gen_gpus"] = gen_gpus
    if inp.backend == "megatron" or device == "cpu":
        fixed.setdefault("offload", rec.offload if inp.backend == "megatron" else False)
    inp = attrs.evolve(inp, shape=shape, cluster=cluster, work=work, fixed=fixed)
    ranked = planning.plan(inp, keep=2, uneven_gather=device != "cpu")  # gloo all-gathers equal sizes only
    fitting = [e for e in ranked if e.fits]
    if not fitting:
        why = ranked[0].memory.problem if ranked else "no layout satisfies the keys the section sets"
        section = "policy.megatron_cfg" if inp.backend == "megatron" else "policy.dtensor_cfg"
        raise ConfigError(f"{section}.layout", f"'auto' found no layout of {world_size} ranks that fits "
                          f"({ranked[0].layout.describe(total) + ': ' if ranked else ''}{why}); run `rlcore plan` for the table")
    return fitting[0], (fitting[1] if len(fitting) > 1 else None)


def describe(best: Estimate, runner_up: Estimate | None, world: int) -> str:
    def one(e: Estimate) -> str:
        lay = e.layout
        return (f"{lay.describe(world)}, recompute {lay.recompute}{', offload' if lay.offload else ''} "
                f"(predicted peak {e.memory.peak_gib:.1f} of {e.memory.limit_gib:.0f} GiB, step {e.step_s:.2f} s)")
    text = f"layout: auto chose {one(best)}"
    return text + (f"; runner-up {one(runner_up)}" if runner_up is not None else "; no other layout fits")
