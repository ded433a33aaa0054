"""The measured rows the planner is held to, and the fit that derives the shipped calibration from them.

Each GPU's calibration comes from its own rows of ``benchmarks/results.jsonl``; a row is named by
:func:`row_key` (bench, variant, run id or date), and the keys each fit used are written beside its values in
``data/calibration.json`` (``rows``). The rows of :data:`HELD_OUT` are never fitted: they check the
planner on runs no calibration saw (``core/tests/test_planning_heldout.py``).

H200 (one GPU):

- ``bench_train_megatron`` (training alone): ``peak_mem_gib`` of every row (it fits ``fixed_gib`` alone: activations
  and logits are counted from the tensors the layers keep, :mod:`rlcore.planning.memory`); ``step_s`` as the training phase for
  the kernels each backend uses now (Megatron's dense rows with Transformer Engine's layers and no FP8; its MoE
  rows with torch's grouped GEMM; FSDP2's rows).
- ``bench_grpo_step`` (whole synchronous GRPO steps, colocated vLLM): ``train_s``, ``refit_s``, ``offload_s``,
  ``logprobs_s`` where the step ran a logprob pass, and ``generation_s`` against the median of the rows of its
  model (the same configuration's generation phase varies 2.6x from host to host). One step off (``async``),
  MPS-shared, FP8, PPO, multi-turn and non-colocated variants are left out: the fit uses synchronous GRPO steps
  with bf16 weights (the planner refuses FP8, and prices one step off and the critic from the phases).
- ``generation`` (vLLM alone, 256 sequences of 64 + 1024 tokens): ``decode_step_ms`` of the bf16 rows with
  one engine per GPU and no MPS cap.

H100 (one GPU): the synchronous GRPO steps of :data:`H100_GRPO` (two dense shapes, Megatron and eager FSDP2) since
:data:`H100_SINCE`, and the refits of :data:`H100_LORA` (the LoRA merge rate). They set what they measure
(:data:`H100_FITTED`: the dense and the eager FSDP2 training efficiencies, decode's host cost and bandwidth
efficiency, the refit's fixed cost, transfer and wake-up rates: two shapes make the fixed costs separable from the
rates); the other compute efficiencies scale from the H200's by the
same training ratio (the same kernels reach a share of each GPU's peak that moves together), and so does the H200's
eager efficiency, which no H200 row measures; memory factors are the H200's.

``python -m rlcore.planning.fit benchmarks/results.jsonl`` refits and rewrites ``data/calibration.json``.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import sys
from pathlib import Path

import attrs
from attrs import frozen

from rlcore.config.schema import LoraConfig
from rlcore.planning import search
from rlcore.planning.bench_shapes import SHAPES, bench_shape
from rlcore.planning.calibration import Calibration
from rlcore.planning.hardware import Cluster, gpu
from rlcore.planning.layout import Layout, Workload
from rlcore.planning.shapes import ModelShape, resolve_shape

MACHINES = {"h200": "1x NVIDIA H200", "h100": "1x NVIDIA H100 80GB HBM3"}  # a row's ``machine`` for each GPU's fit


def row_key(r: dict) -> tuple[str, str, str]:
    """A row's name: (bench, variant, run id, or the date of a row written without one)."""
    return (r.get("bench", ""), r.get("variant", ""), r.get("run_id") or r.get("date", ""))


# Rows no fit may use: the planner is checked on them (core/tests/test_planning_heldout.py)
HELD_OUT = frozenset({
    # Qwen3-30B-A3B's layer at 10 layers, 4 x 8192 tokens: the edge of one H200's memory
    ("bench_train_megatron", "megatron", "20261204T202223-ad26cf"),
    # PPO: the critic's phases and state beside the policy's (H200; the H100's below)
    ("bench_grpo_step", "llama1b-fsdp2-ppo [policy.generation.gpu_memory_utilization=0.25]", "20261205T171548-d0c101"),
    ("bench_grpo_step", "llama1b-megatron-ppo [policy.generation.gpu_memory_utilization=0.25] "
     "[policy.megatron_cfg.empty_unused_memory_level=1]", "2026-12-05T17:15:00+00:00"),
    # the single-GPU 1.2B configurations other than the two the H100 fit reads, with no memory key set: the run's
    # memory plan chose the engine's share and the release (H100, benchmarks/gpu/fits.sh)
    ("bench_grpo_step", "llama1b-megatron-cuda-graph", "20261206T130822-e13175"),
    ("bench_grpo_step", "llama1b-multiturn-async", "20261206T131027-79a6b3"),
    ("bench_grpo_step", "llama1b-megatron-ppo", "20261206T131501-f110d1"),
    ("bench_grpo_step", "llama1b-fsdp2-ppo", "20261206T131701-fba1d0"),
    ("bench_grpo_step", "llama1b-fsdp2-compile", "20261206T131920-84ae4a"),
    ("bench_grpo_step", "llama1b-megatron-fp8gen", "20261206T132141-c46726"),
    ("bench_grpo_step", "llama1b-tool-async", "20261206T162816-00ed10"),
    # a shape no calibration read: rank-16 LoRA on a 3B Llama (H100, no memory key set)
    ("bench_grpo_step", "llama3b-megatron-lora", "20261206T162137-ec0ce7"),
    ("bench_grpo_step", "llama3b-fsdp2-lora", "20261206T162456-4a2e1f"),
    # a fitted configuration measured again after the fit, in other calls (the vLLM half of the SGLang pair; the
    # run that recorded each phase's memory growth)
    ("bench_grpo_step", "llama1b-fsdp2", "20261206T190757-6ea32a"),
    ("bench_grpo_step", "llama1b-fsdp2", "20261206T224004-d8361c"),
    # torch's allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF), the plan's tensors against the device
    ("bench_grpo_step", "llama1b-fsdp2 [PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True]", "20261207T014803-e4dba0"),
    ("bench_grpo_step", "llama1b-megatron-cuda-graph [PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True]",
     "20261207T015051-ad10e1"),
    # the same, now rlcore.run's default (no variable set by hand)
    ("bench_grpo_step", "llama1b-fsdp2", "20261207T051427-f51d6a"),
    ("bench_grpo_step", "llama1b-megatron-cuda-graph", "20261207T051714-1c697a"),
    ("bench_grpo_step", "llama1b-megatron", "20261207T051930-a212f3"),
    # the list under the allocator default, with the engine shut down awake; each allocator pair from one call
    ("bench_grpo_step", "llama1b-megatron", "20261207T065007-2872f3"),
    ("bench_grpo_step", "llama1b-megatron [PYTORCH_CUDA_ALLOC_CONF=]", "20261207T065303-4bbcc9"),
    ("bench_grpo_step", "llama1b-tool-agent", "20261207T065511-9c4919"),
    ("bench_grpo_step", "llama1b-multiturn-sync-barrier", "20261207T065808-011cce"),
    ("bench_grpo_step", "llama1b-multiturn-async", "20261207T070209-3fb847"),
    ("bench_grpo_step", "llama1b-fsdp2-compile", "20261207T070434-a5f74a"),
    ("bench_grpo_step", "llama1b-tool-async", "20261207T070703-0a4b07"),
    ("bench_grpo_step", "llama1b-fsdp2", "20261207T070926-1062ac"),
    ("bench_grpo_step", "llama1b-fsdp2 [PYTORCH_CUDA_ALLOC_CONF=]", "20261207T071124-2c501e"),
    ("bench_grpo_step", "llama0.5b-megatron", "20261207T071311-1e5a75"),
    # the hand-set comparison, each side run twice in one call (ABBA), and the agent with its longest trajectory
    ("bench_grpo_step", "llama1b-fsdp2", "20261207T084248-eaf864"),
    ("bench_grpo_step", "llama1b-fsdp2 [PYTORCH_CUDA_ALLOC_CONF=]", "20261207T084607-a86c9b"),
    ("bench_grpo_step", "llama1b-fsdp2 [PYTORCH_CUDA_ALLOC_CONF=]", "20261207T084823-f1b4f2"),
    ("bench_grpo_step", "llama1b-megatron", "20261207T085025-8d27a7"),
    ("bench_grpo_step", "llama1b-megatron [PYTORCH_CUDA_ALLOC_CONF=]", "20261207T085218-e0bd1c"),
    ("bench_grpo_step", "llama1b-megatron [PYTORCH_CUDA_ALLOC_CONF=]", "20261207T085413-878f91"),
    ("bench_grpo_step", "llama1b-megatron", "20261207T085623-21aa5f"),
    ("bench_grpo_step", "llama1b-tool-agent", "20261207T085835-e01c8f"),
    ("bench_grpo_step", "llama0.5b-megatron", "20261207T090150-07c710"),
    ("bench_grpo_step", "llama0.5b-megatron [PYTORCH_CUDA_ALLOC_CONF=]", "20261207T090445-77a5aa"),
    # multi-turn with the async engine at two steps (the second timed), no memory key against the settings it was run
    # with by hand
    ("bench_grpo_step", "llama1b-multiturn-async", "20261207T125940-92697c"),
    ("bench_grpo_step", "llama1b-multiturn-async [policy.generation.gpu_memory_utilization=0.2] "
     "[policy.megatron_cfg.empty_unused_memory_level=1]", "20261207T130407-1ae12e"),
    # PPO under the allocator default (expandable segments), no memory key
    ("bench_grpo_step", "llama1b-megatron-ppo", "20261207T155852-afdb85"),
    # both PPO configurations with no memory key against the settings they were run with by hand, in one machine's
    # calls (fsdp2: no key, hand-set, hand-set, no key)
    ("bench_grpo_step", "llama1b-fsdp2-ppo", "20261207T215322-235228"),
    ("bench_grpo_step", "llama1b-fsdp2-ppo [policy.generation.gpu_memory_utilization=0.25]", "20261207T215815-34045a"),
    ("bench_grpo_step", "llama1b-megatron-ppo", "20261207T220119-05283a"),
    ("bench_grpo_step", "llama1b-megatron-ppo [policy.generation.gpu_memory_utilization=0.25] "
     "[policy.megatron_cfg.empty_unused_memory_level=1]", "20261207T220410-9f47b1"),
    ("bench_grpo_step", "llama1b-fsdp2-ppo [policy.generation.gpu_memory_utilization=0.25]", "20261207T220651-a01ffb"),
    ("bench_grpo_step", "llama1b-fsdp2-ppo", "20261207T220932-ab9a4c"),
})
# the training benchmark's packed lengths: uniform in [256, 2048]
TRAIN_MEAN, TRAIN_SQ_MEAN = 1152.0, (2048**3 - 256**3) / (3 * 1792)
MOE_LAYERS = 8  # benchmarks/moe_shapes.py: the depth one H200 trains


@frozen
class Case:
    row: int  # line number in results.jsonl (1-based)
    variant: str
    shape: ModelShape
    work: Workload
    layout: Layout
    measured: dict  # quantity -> value
    gpu_name: str = "h200"


def _shape(name: str, layers: int | None = None) -> ModelShape:
    return resolve_shape("", "qwen3moe", layers or MOE_LAYERS) if "moe" in name else resolve_shape("", "llama-3.2-1b")


def grpo_bench_shape(name: str) -> ModelShape:
    """The model of a ``bench_grpo_step`` row: the MoE slice at the fit's depth, else the benchmark model its
    configuration's name begins with (``llama0.5b-fsdp2``: :data:`rlcore.planning.bench_shapes.SHAPES`'s
    ``llama0.5b``; the held-out test checks this against each configuration's own model)."""
    if "moe" in name:
        return _shape(name)
    model = name.split("-")[0]
    if model not in SHAPES:
        raise ValueError(f"benchmark configuration {name!r}: its model {model!r} is not one of {', '.join(SHAPES)}")
    return bench_shape(model)


def _train_case(i: int, r: dict) -> Case | None:
    m = re.match(r"(\w+)(?: x(\d+) layers)?, (\d+) x (\d+) tokens", r["config"])
    if not m or r.get("peak_mem_gib") is None:
        return None
    layers = int(m.group(2)) if m.group(2) else None
    shape, budget = _shape(m.group(1), layers), int(m.group(4))
    backend = "fsdp2" if r["variant"].startswith("fsdp2") else "megatron"
    work = attrs.evolve(training_alone(r["tokens_per_step"]), compiled="compile" in r["variant"])
    measured = {"peak_mem_gib": r["peak_mem_gib"]}
    kernels = r.get("kernels", "")
    current = (backend == "fsdp2") or ("fp8" not in kernels and "transformer_engine layers" in kernels and
                                       (not shape.moe or "torch grouped_mm" in kernels) and "te-attn" not in r["variant"])
    if current:
        measured["train_s"] = r["step_s"]
    return Case(i, r["variant"], shape, work, Layout(backend=backend, train_mb_tokens=budget, colocated=True), measured)


def training_alone(tokens: float) -> Workload:
    """The training benchmark's step (``bench_train_megatron.py``): ``tokens`` in packed sequences of 256-2048 tokens."""
    return Workload(samples=round(tokens / TRAIN_MEAN), prompt_tokens=int(TRAIN_MEAN), response_tokens=0, max_seq=2048,
                    logprob_passes=0, generation=False, seq_sq_mean=TRAIN_SQ_MEAN, uniform_lengths=False)


SYNC_GRPO = ("llama1b-megatron", "llama1b-fsdp2-compile", "llama1b-megatron-cuda-graph", "qwen3moe-megatron",
             "qwen3moe-megatron-r2", "qwen3moe-megatron-r3")


def _grpo_case(i: int, r: dict) -> Case | None:
    if r["variant"] not in SYNC_GRPO or "8192-token" not in r["config"]:
        return None
    if "(summary after 0)" in r["config"]:  # its means include the first step's one-time work (allocation, tuning)
        return None
    shape = grpo_bench_shape(r["variant"])
    moe = shape.moe
    passes = 1 if (r.get("logprobs_s") or 0) > 0.05 else 0  # later rows skip the pass (one optimizer step a batch)
    work = Workload(samples=256, prompt_tokens=16, response_tokens=1024, max_seq=1088, logprob_passes=passes,
                    compiled="compile" in r["variant"])
    lay = Layout(backend="fsdp2" if "fsdp2" in r["variant"] else "megatron", train_mb_tokens=8192, logprob_mb_tokens=16384,
                 offload=moe, gen_memory_fraction=0.3 if moe else 0.5)
    measured = {k: r[k] for k in ("train_s", "refit_s") if r.get(k)}
    if passes:
        measured["logprobs_s"] = r["logprobs_s"]
    if moe and r.get("offload_s"):
        measured["offload_s"] = r["offload_s"]
    return Case(i, r["variant"], shape, work, lay, measured)


def _generation_case(i: int, r: dict) -> Case | None:
    if r.get("quantization") != "none" or "mps" in r["variant"] or r.get("engines_per_gpu", 1) != 1 or r.get("mode") != "graphs":
        return None
    shape = resolve_shape("", "llama-3.2-1b" if r["shape"] == "1.2b" else "llama-3.1-8b")
    work = Workload(samples=r["num_prompts"] * r["samples_per_prompt"], prompt_tokens=r["prompt_len"],
                    response_tokens=r["new_tokens"], max_seq=r["prompt_len"] + r["new_tokens"], logprob_passes=0)
    lay = Layout(colocated=False, gen_gpus=1, gen_memory_fraction=0.5)
    return Case(i, r["variant"], shape, work, lay, {"decode_step_ms": r["decode_step_ms"]})


H100_GRPO = ("llama1b-megatron", "llama1b-fsdp2", "llama0.5b-megatron", "llama0.5b-fsdp2")
# Rows of the colocated engine that wakes in two halves (its KV cache mapped after the refit, not in it) and whose
# share the run's memory plan set: earlier rows timed a refit phase that no longer exists.
H100_SINCE = "2026-12-06T12:00"


def _h100_case(i: int, r: dict) -> Case | None:
    """A synchronous GRPO step on one H100, planned with its own engine share (the run's memory plan); of a LoRA
    row (:data:`H100_LORA`), its refit alone."""
    if r["bench"] != "bench_grpo_step" or "(summary after 0)" in r["config"]:
        return None
    if r["variant"] in H100_LORA:
        return _h100_lora_case(i, r)
    if r["variant"] not in H100_GRPO or r["date"] < H100_SINCE:
        return None
    response = round(r["tokens_per_sample"])
    work = Workload(samples=r["samples"], prompt_tokens=16, response_tokens=response, max_seq=r["max_new_tokens"] + 64,
                    logprob_passes=int((r.get("logprobs_s") or 0) > 0.05))
    lay = Layout(backend="fsdp2" if "fsdp2" in r["variant"] else "megatron", train_mb_tokens=8192, logprob_mb_tokens=16384,
                 gen_memory_fraction=r["memory_plan/engine_fraction"])
    return Case(i, r["variant"], grpo_bench_shape(r["variant"]), work, lay, {k: r[k] for k in ("train_s", "refit_s")}, "h100")


# LoRA rank 16 on the default projections (the benchmark's LoRA configurations): their refits set the merge rate
H100_LORA = ("llama8b-megatron-lora", "llama8b-fsdp2-lora")


def _h100_lora_case(i: int, r: dict) -> Case:
    shape = grpo_bench_shape(r["variant"])
    work = Workload(samples=r["samples"], prompt_tokens=16, response_tokens=round(r["tokens_per_sample"]),
                    max_seq=r["max_new_tokens"] + 64, lora_params=shape.lora_params(16, LoraConfig().target_modules))
    lay = Layout(backend="fsdp2" if "fsdp2" in r["variant"] else "megatron", train_mb_tokens=8192,
                 gen_memory_fraction=r["memory_plan/engine_fraction"])
    return Case(i, r["variant"], shape, work, lay, {"refit_s": r["refit_s"]}, "h100")


def cases(path: Path, gpu_name: str = "h200") -> list[Case]:
    """The rows ``gpu_name``'s calibration is fitted to (never one of :data:`HELD_OUT`)."""
    makers = ({"bench_train_megatron": _train_case, "bench_grpo_step": _grpo_case, "generation": _generation_case}
              if gpu_name == "h200" else {"bench_grpo_step": _h100_case})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = []
    for i, r in enumerate(rows, 1):
        if r.get("machine") != MACHINES[gpu_name] or r.get("gpus") != 1 or row_key(r) in HELD_OUT:
            continue
        make = makers.get(r["bench"])
        case = make(i, r) if make else None
        if case is not None and case.measured:
            out.append(case)
    _generation_medians(rows, out)
    return out


def _generation_medians(rows: list[dict], out: list[Case]) -> None:
    """Attach to each GRPO case the median generation phase of the synchronous rows of its model."""
    grpo = [k for k, c in enumerate(out) if rows[c.row - 1]["bench"] == "bench_grpo_step" and "train_s" in c.measured]
    by_model: dict[str, list[float]] = {}
    for k in grpo:
        by_model.setdefault(out[k].shape.name, []).append(rows[out[k].row - 1]["generation_s"])
    for k in grpo:
        c = out[k]
        out[k] = attrs.evolve(c, measured={**c.measured, "generation_s": statistics.median(by_model[c.shape.name])})


def predict(case: Case, cal: Calibration) -> dict:
    if "decode_step_ms" in case.measured:
        from rlcore.planning import memory, timing

        pair = Cluster(gpu(case.gpu_name), 1, 2)  # one GPU generates (the other would train)
        mem = memory.estimate(case.shape, case.work, case.layout, pair, cal)
        seconds, _ = timing.generation_s(case.shape, case.work, case.layout, pair, cal, mem)
        return {"decode_step_ms": seconds / case.work.response_tokens * 1e3}
    est = search.evaluate(case.shape, case.work, case.layout, Cluster(gpu(case.gpu_name), 1, 1), cal)
    names = {"training": "train_s", "logprobs": "logprobs_s", "generation": "generation_s", "refit": "refit_s", "offload": "offload_s"}
    # torch's peak of live tensors: without the reduce-scatter stream's cached blocks (no tensor lives there at the
    # peak of a training step; the device's peak counts them)
    live_gib = est.memory.peak_gib - est.memory.train_parts.get("reduce_scatter", 0.0)
    return {"peak_mem_gib": live_gib, **{names[k]: v for k, v in est.phases.items()}}


def errors(all_cases: list[Case], cal: Calibration) -> list[tuple[Case, str, float, float]]:
    """(case, quantity, predicted, measured) for every measured quantity."""
    out = []
    for c in all_cases:
        pred = predict(c, cal)
        out += [(c, q, pred[q], v) for q, v in c.measured.items()]
    return out


# parameter -> (quantities it drives, candidate values)
GRID = {
    "train_efficiency": (("train_s",), [x / 100 for x in range(25, 81)]),
    "eager_efficiency": (("train_s",), [x / 100 for x in range(15, 81)]),
    "moe_efficiency": (("train_s",), [x / 100 for x in range(10, 71)]),
    "fsdp2_moe_efficiency": (("train_s",), [x / 100 for x in range(5, 61)]),
    "per_microbatch_s": (("train_s", "logprobs_s"), [x / 1000 for x in range(0, 41, 2)]),
    "forward_efficiency": (("logprobs_s",), [x / 100 for x in range(20, 81)]),
    "fixed_gib": (("peak_mem_gib",), [x / 4 for x in range(0, 13)]),
    "decode_host_ms": (("decode_step_ms", "generation_s"), [x / 2 for x in range(4, 31)]),
    "decode_bandwidth_efficiency": (("decode_step_ms", "generation_s"), [x / 20 for x in range(8, 20)]),
    "refit_fixed_s": (("refit_s",), [x / 100 for x in range(0, 41, 2)]),
    "refit_gbps": (("refit_s",), [float(x) for x in range(4, 61, 2)]),
    "wake_gibps": (("refit_s",), [float(x) for x in range(100, 1001, 25)]),
    "lora_merge_gbps": (("refit_s",), [float(x) for x in range(4, 81, 2)]),
    "offload_gbps": (("offload_s",), [float(x) for x in range(10, 121, 5)]),
}


def _eager(c: Case) -> bool:
    return c.layout.backend == "fsdp2" and not c.work.compiled


# the training efficiency each case's training phase reads (:func:`rlcore.planning.timing._pass_s`): a parameter is
# fitted to the cases it prices, or a case it does not price would hold the worst error whatever its value
TRAINING_EFFICIENCY = {
    "train_efficiency": lambda c: not c.shape.moe and not _eager(c),
    "eager_efficiency": lambda c: not c.shape.moe and _eager(c),
    "moe_efficiency": lambda c: c.shape.moe and c.layout.backend != "fsdp2",
    "fsdp2_moe_efficiency": lambda c: c.shape.moe and c.layout.backend == "fsdp2",
}


def _drives(name: str, c: Case) -> bool:
    return TRAINING_EFFICIENCY.get(name, lambda _: True)(c)


# what the H100 rows measure; the other compute efficiencies follow the training ratio (see the module's text)
H100_FITTED = ("train_efficiency", "eager_efficiency", "decode_host_ms", "decode_bandwidth_efficiency", "refit_fixed_s",
               "refit_gbps", "wake_gibps", "lora_merge_gbps")
H100_SCALED = ("moe_efficiency", "fsdp2_moe_efficiency", "forward_efficiency", "prefill_efficiency")


REFIT = ("refit_fixed_s", "refit_gbps", "wake_gibps")  # searched together: each row's refit is their sum


def _fit_refit(all_cases: list[Case], cal: Calibration, names: tuple) -> Calibration:
    """The refit's parameters among ``names`` over their whole grid at once on the full fine-tuning rows (the refit
    is priced from memory that does not depend on them, so each case's memory is estimated once), then a LoRA
    run's merge rate on the LoRA rows, the rest fixed."""
    from rlcore.planning import memory, timing

    if "lora_merge_gbps" in names:
        full = [c for c in all_cases if not c.work.lora_params]
        cal = _fit_refit(full, cal, tuple(n for n in names if n != "lora_merge_gbps"))
        lora = [c for c in all_cases if c.work.lora_params and "refit_s" in c.measured]
        if not lora:
            return cal
        mems = [memory.estimate(c.shape, c.work, c.layout, Cluster(gpu(c.gpu_name), 1, 1), cal) for c in lora]

        def worst_merge(value):
            trial = attrs.evolve(cal, lora_merge_gbps=value)
            return max(abs(timing.refit_s(c.shape, c.work, c.layout, Cluster(gpu(c.gpu_name), 1, 1), trial, m)
                           / c.measured["refit_s"] - 1) for c, m in zip(lora, mems))
        return attrs.evolve(cal, lora_merge_gbps=min(GRID["lora_merge_gbps"][1], key=worst_merge))
    subset = [c for c in all_cases if "refit_s" in c.measured]
    clusters = [Cluster(gpu(c.gpu_name), 1, 1) for c in subset]
    mems = [memory.estimate(c.shape, c.work, c.layout, k, cal) for c, k in zip(subset, clusters)]
    grids = [GRID[n][1] if n in names else [getattr(cal, n)] for n in REFIT]

    def worst(values):
        trial = attrs.evolve(cal, **dict(zip(REFIT, values)))
        return max(abs(timing.refit_s(c.shape, c.work, c.layout, k, trial, m) / c.measured["refit_s"] - 1)
                   for c, k, m in zip(subset, clusters, mems))
    return attrs.evolve(cal, **dict(zip(REFIT, min(itertools.product(*grids), key=worst)))) if subset else cal


def fit(all_cases: list[Case], rounds: int = 4, start: Calibration | None = None, names: tuple = tuple(GRID),
        source: str = "shipped (h200 rows)") -> Calibration:
    """Coordinate descent on the grid over ``names``: each value minimizes the worst relative error of the
    quantities it drives; the rest stay ``start``'s. The refit's parameters are searched jointly, last."""
    cal = start or Calibration()
    for _ in range(rounds):
        for name in (n for n in names if n not in REFIT and n != "lora_merge_gbps"):  # those: _fit_refit
            quantities, values = GRID[name]
            subset = [c for c in all_cases if set(quantities) & set(c.measured) and _drives(name, c)]
            if not subset:  # no row measures it: it keeps its value
                continue
            def worst(v, subset=subset, quantities=quantities, name=name):
                trial = attrs.evolve(cal, **{name: v})
                return max((abs(p / m - 1) for _, q, p, m in errors(subset, trial) if q in quantities), default=0.0)
            cal = attrs.evolve(cal, **{name: min(values, key=worst)})
    return attrs.evolve(_fit_refit(all_cases, cal, names), source=source)


def fit_h100(h100_cases: list[Case], h200: Calibration) -> Calibration:
    cal = fit(h100_cases, start=h200, names=H100_FITTED, source="shipped (h100 rows)")
    ratio = cal.train_efficiency / h200.train_efficiency
    return attrs.evolve(cal, **{n: round(getattr(h200, n) * ratio, 3) for n in H100_SCALED})


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "benchmarks/results.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    fitted = {"h200": cases(path, "h200"), "h100": cases(path, "h100")}
    cals = {"h200": fit(fitted["h200"])}
    cals["h100"] = fit_h100(fitted["h100"], cals["h200"])
    # no H200 row trains a dense model on eager FSDP2: its eager efficiency moves with its training efficiency as the
    # H100's does (the same kernels)
    h100 = cals["h100"]
    cals["h200"] = attrs.evolve(cals["h200"], eager_efficiency=round(
        cals["h200"].train_efficiency * h100.eager_efficiency / h100.train_efficiency, 3))
    out = {}
    for name, cal in cals.items():
        values = {f.name: getattr(cal, f.name) for f in attrs.fields(Calibration) if f.name != "source"}
        out[name] = {**values, "rows": sorted({row_key(rows[c.row - 1]) for c in fitted[name]})}
        for c, q, p, m in errors(fitted[name], cal):
            print(f"{name} row {c.row:4d} {c.variant:40s} {q:15s} predicted {p:8.3f} measured {m:8.3f} ({p / m - 1:+.0%})")
    (Path(__file__).with_name("data") / "calibration.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
