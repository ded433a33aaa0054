"""The layout search: enumerate candidates a constraint set allows, estimate each, rank by step time.

Training layouts are estimated once per trainer world size and combined with the generation options
(colocated, or a share of the GPUs of its own; engine tensor-parallel size; replicas fill the rest), so
a 64-GPU MoE search stays well under a second. For each training layout only the largest micro-batch
budget that fits is kept (a larger budget costs fewer micro-batches; past fitting it only adds memory).
"""

from __future__ import annotations

import heapq
import itertools

import attrs
from attrs import frozen

from rlcore.planning import memory, timing
from rlcore.planning.calibration import Calibration
from rlcore.planning.hardware import Cluster
from rlcore.planning.layout import Layout, Workload
from rlcore.planning.shapes import ModelShape

BUDGETS = (2048, 4096, 8192, 16384, 32768, 65536)
RECOMPUTE = ("none", "selective", "full")


@frozen
class Estimate:
    layout: Layout
    memory: memory.Memory
    phases: dict
    overlapped: bool = False  # one step off, generation on GPUs of its own: see timing.step_s

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def step_s(self) -> float:
        return timing.step_s(self.phases, self.overlapped)


def evaluate(shape: ModelShape, work: Workload, lay: Layout, cluster: Cluster, cal: Calibration) -> Estimate:
    mem = memory.estimate(shape, work, lay, cluster, cal)
    lay = attrs.evolve(lay, gen_memory_fraction=mem.engine_fraction)
    overlapped = work.one_step_off and work.generation and not lay.colocated
    return Estimate(lay, mem, timing.phases(shape, work, lay, cluster, cal, mem), overlapped)


def _pow2(limit: int) -> list[int]:
    return [1 << i for i in range(0, 12) if (1 << i) <= limit]


def _allowed(name: str, values, fixed: dict) -> list:
    return [fixed[name]] if name in fixed else list(values)


def training_layouts(shape: ModelShape, work: Workload, world: int, cluster: Cluster, backend: str, fixed: dict,
                     virtual_stages: bool, uneven_gather: bool = True):
    """Trainer layouts for ``world`` ranks, without micro-batch budgets (those are searched per layout).

    ``uneven_gather=False`` (gloo): no expert-tensor parallelism beside expert parallelism, where Megatron's
    all-to-all dispatcher all-gathers the routed tokens in per-rank counts that differ, which gloo refuses."""
    per_node = cluster.gpus_per_node
    tps = [t for t in _allowed("tp", _pow2(min(per_node, world)), fixed)
           if shape.heads % t == 0 and shape.kv_heads % t == 0 and world % t == 0]
    if backend == "fsdp2":
        for tp, rec, off in itertools.product(tps, _allowed("recompute", ("none", "full"), fixed),
                                              _allowed("offload", (False, True), fixed)):
            yield Layout(backend="fsdp2", tp=tp, sp=fixed.get("sp", tp > 1), recompute=rec, offload=off)
        return
    pps = [p for p in _allowed("pp", [p for p in range(1, min(shape.layers, 16) + 1) if shape.layers % p == 0], fixed)]
    cps = _allowed("cp", (1, 2, 4) if work.packing else (1,), fixed)
    eps = _allowed("ep", [e for e in _pow2(world) if shape.experts % e == 0] if shape.moe else (1,), fixed)
    for tp, pp, cp, ep in itertools.product(tps, pps, cps, eps):
        if world % (tp * pp * cp) or (pp > 1 and pp > shape.layers):
            continue
        vpps = [v for v in ((1, 2) if virtual_stages and pp > 1 else (1,)) if shape.layers % (pp * v) == 0]
        for etp in _allowed("etp", sorted({1, tp}) if shape.moe else (tp,), fixed):
            if world % (etp * ep * pp) or (shape.moe and ep == 1 and etp < tp) or (not uneven_gather and ep > 1 and etp > 1):
                continue
            sp = fixed.get("sp", tp > 1)
            if sp and tp == 1 or (shape.moe and tp > 1 and not sp):
                continue
            for vpp, rec in itertools.product(vpps, _allowed("recompute", RECOMPUTE, fixed)):
                yield Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, sp=sp, recompute=rec)


def generation_options(shape: ModelShape, cluster: Cluster, fixed: dict, generation: bool):
    """(colocated, gen_gpus, gen_tp) triples."""
    if not generation:
        yield True, 0, 1
        return
    world, per_node = cluster.world, cluster.gpus_per_node
    tps = [t for t in _allowed("gen_tp", _pow2(per_node), fixed) if shape.heads % t == 0]
    splits = [(True, 0)]
    if world > 1 and fixed.get("colocated", False) is False:
        splits += sorted({(False, g) for g in (world // 2, world // 4) if g >= 1})
    if fixed.get("colocated") is False:
        splits = [s for s in splits if not s[0]]
    if "gen_gpus" in fixed:
        splits = [(False, fixed["gen_gpus"])]
    for (colocated, gen_gpus), gtp in itertools.product(splits, tps):
        gpus = world if colocated else gen_gpus
        if gpus % gtp == 0 and ("gen_replicas" not in fixed or gpus // gtp == fixed["gen_replicas"]):
            yield colocated, gen_gpus, gtp


def search(shape: ModelShape, work: Workload, cluster: Cluster, cal: Calibration, *, backend: str = "megatron",
           fixed: dict | None = None, virtual_stages: bool = False, keep: int = 40, uneven_gather: bool = True) -> list[Estimate]:
    """Every fitting candidate's best micro-batch budget, ranked by step time, then non-fitting ones."""
    fixed = dict(fixed or {})
    results: list[Estimate] = []
    by_world: dict[int, list[Layout]] = {}
    for colocated, gen_gpus, gen_tp in generation_options(shape, cluster, fixed, work.generation):
        world = cluster.world if colocated else cluster.world - gen_gpus
        if world not in by_world:
            by_world[world] = list(training_layouts(shape, work, world, cluster, backend, fixed, virtual_stages, uneven_gather))
        # Megatron's offload is the generation section's (state to host while engines are awake); FSDP2's is its own
        offloads = _allowed("offload", (False, True) if colocated and work.generation and backend == "megatron" else (None,), fixed)
        for base, off in itertools.product(by_world[world], offloads):
            lay = base.with_(colocated=colocated, gen_gpus=gen_gpus, gen_tp=gen_tp, offload=base.offload if off is None else off,
                             gen_memory_fraction=fixed.get("gen_memory_fraction", 0.0))
            best = _best_budget(shape, work, lay, cluster, cal, fixed)
            if best is not None:
                results.append(best)
    fitting = heapq.nsmallest(keep, (r for r in results if r.fits), key=lambda r: r.step_s)
    failing = sorted((r for r in results if not r.fits), key=lambda r: r.memory.peak_gib - r.memory.limit_gib)[:keep]
    return fitting + failing


def _best_budget(shape, work, lay, cluster, cal, fixed) -> Estimate | None:
    if "train_mb_tokens" in fixed or not work.packing:  # unpacked: micro-batches are sequences, budgets do not apply
        budgets = [fixed.get("train_mb_tokens", lay.train_mb_tokens)]
    else:
        budgets = [b for b in BUDGETS if b >= min(work.max_seq, BUDGETS[-1]) // 2]
    smallest = None
    for budget in sorted(budgets, reverse=True):
        lp = fixed.get("logprob_mb_tokens", 2 * budget)
        est = evaluate(shape, work, lay.with_(train_mb_tokens=budget, logprob_mb_tokens=lp), cluster, cal)
        if est.fits:
            return est
        smallest = est
    return smallest
