"""The measured rows the planner is held to, and the fit that derives the shipped calibration from them.

The H200 rows of ``benchmarks/results.jsonl`` that carry what a prediction needs:

- ``bench_train_megatron`` (training alone, one GPU): ``peak_mem_gib`` of every row; ``step_s`` as the
  training phase for the kernels each backend uses now (Megatron's dense rows with Transformer Engine's
  layers and no FP8; its MoE rows with torch's grouped GEMM; FSDP2's rows).
- ``bench_grpo_step`` (whole synchronous GRPO steps, one GPU, colocated vLLM): ``train_s``, ``refit_s``,
  ``offload_s``, ``logprobs_s`` where the step ran a logprob pass, and ``generation_s`` against the median
  of the rows of its model (the same configuration's generation phase varies 2.6x from host to host).
  One step off (``async``), MPS-shared, FP8 and non-colocated variants are left out: the fit uses
  synchronous steps with bf16 weights (the planner refuses FP8, and prices one step off from the phases).
- ``generation`` (vLLM alone, 256 sequences of 64 + 1024 tokens): ``decode_step_ms`` of the bf16 rows with
  one engine per GPU and no MPS cap.

``python -m rlcore.planning.fit benchmarks/results.jsonl`` refits and rewrites ``data/calibration.json``.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import attrs
from attrs import frozen

from rlcore.planning import search
from rlcore.planning.calibration import Calibration
from rlcore.planning.hardware import Cluster, gpu
from rlcore.planning.layout import Layout, Workload
from rlcore.planning.shapes import ModelShape, resolve_shape

H200 = Cluster(gpu("h200"), 1, 1)
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


def _shape(name: str, layers: int | None = None) -> ModelShape:
    return resolve_shape("", "qwen3moe", layers or MOE_LAYERS) if "moe" in name else resolve_shape("", "llama-3.2-1b")


def _train_case(i: int, r: dict) -> Case | None:
    m = re.match(r"(\w+)(?: x(\d+) layers)?, (\d+) x (\d+) tokens", r["config"])
    if not m or r.get("peak_mem_gib") is None:
        return None
    layers = int(m.group(2)) if m.group(2) else None
    shape, budget = _shape(m.group(1), layers), int(m.group(4))
    backend = "fsdp2" if r["variant"].startswith("fsdp2") else "megatron"
    work = training_alone(r["tokens_per_step"])
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
    shape = _shape(r["variant"])
    moe = shape.moe
    passes = 1 if (r.get("logprobs_s") or 0) > 0.05 else 0  # later rows skip the pass (one optimizer step a batch)
    work = Workload(samples=256, prompt_tokens=16, response_tokens=1024, max_seq=1088, logprob_passes=passes)
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


def cases(path: Path) -> list[Case]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        r = json.loads(line)
        if "H200" not in r.get("machine", "") or r.get("gpus") != 1:
            continue
        make = {"bench_train_megatron": _train_case, "bench_grpo_step": _grpo_case, "generation": _generation_case}.get(r["bench"])
        case = make(i, r) if make else None
        if case is not None and case.measured:
            out.append(case)
    _generation_medians(path, out)
    return out


def _generation_medians(path: Path, out: list[Case]) -> None:
    """Attach to each GRPO case the median generation phase of the synchronous rows of its model."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_model: dict[bool, list[float]] = {}
    for c in out:
        if c.variant in SYNC_GRPO:
            by_model.setdefault(c.shape.moe, []).append(rows[c.row - 1]["generation_s"])
    for k, c in enumerate(out):
        if c.variant in SYNC_GRPO:
            out[k] = attrs.evolve(c, measured={**c.measured, "generation_s": statistics.median(by_model[c.shape.moe])})


def predict(case: Case, cal: Calibration) -> dict:
    if "decode_step_ms" in case.measured:
        from rlcore.planning import memory, timing

        pair = Cluster(H200.gpu, 1, 2)  # one GPU generates (the other would train)
        mem = memory.estimate(case.shape, case.work, case.layout, pair, cal)
        seconds, _ = timing.generation_s(case.shape, case.work, case.layout, pair, cal, mem)
        return {"decode_step_ms": seconds / case.work.response_tokens * 1e3}
    est = search.evaluate(case.shape, case.work, case.layout, H200, cal)
    names = {"training": "train_s", "logprobs": "logprobs_s", "generation": "generation_s", "refit": "refit_s", "offload": "offload_s"}
    return {"peak_mem_gib": est.memory.peak_gib, **{names[k]: v for k, v in est.phases.items()}}


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
    "moe_efficiency": (("train_s",), [x / 100 for x in range(10, 71)]),
    "fsdp2_moe_efficiency": (("train_s",), [x / 100 for x in range(5, 61)]),
    "per_microbatch_s": (("train_s", "logprobs_s"), [x / 1000 for x in range(0, 41, 2)]),
    "forward_efficiency": (("logprobs_s",), [x / 100 for x in range(20, 81)]),
    "activation_factor": (("peak_mem_gib",), [x / 20 for x in range(4, 41)]),
    "logits_bytes": (("peak_mem_gib",), [x / 2 for x in range(4, 33)]),
    "fixed_gib": (("peak_mem_gib",), [x / 4 for x in range(0, 13)]),
    "decode_host_ms": (("decode_step_ms", "generation_s"), [x / 2 for x in range(4, 31)]),
    "decode_bandwidth_efficiency": (("decode_step_ms", "generation_s"), [x / 20 for x in range(8, 20)]),
    "refit_fixed_s": (("refit_s",), [x / 100 for x in range(0, 41, 2)]),
    "refit_gbps": (("refit_s",), [float(x) for x in range(4, 61, 2)]),
    "offload_gbps": (("offload_s",), [float(x) for x in range(10, 121, 5)]),
}


def fit(all_cases: list[Case], rounds: int = 4) -> Calibration:
    """Coordinate descent on the grid: each value minimizes the worst relative error of the quantities it drives."""
    cal = Calibration()
    for _ in range(rounds):
        for name, (quantities, values) in GRID.items():
            subset = [c for c in all_cases if set(quantities) & set(c.measured)]
            def worst(v, subset=subset, quantities=quantities, name=name):
                trial = attrs.evolve(cal, **{name: v})
                return max((abs(p / m - 1) for _, q, p, m in errors(subset, trial) if q in quantities), default=0.0)
            cal = attrs.evolve(cal, **{name: min(values, key=worst)})
    return attrs.evolve(cal, source="shipped (h200 rows)")


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "benchmarks/results.jsonl")
    all_cases = cases(path)
    cal = fit(all_cases)
    values = {f.name: getattr(cal, f.name) for f in attrs.fields(Calibration) if f.name != "source"}
    out = Path(__file__).with_name("data") / "calibration.json"
    out.write_text(json.dumps({"h200": {**values, "rows": sorted({c.row for c in all_cases})}}, indent=1) + "\n")
    for c, q, p, m in errors(all_cases, cal):
        print(f"row {c.row:4d} {c.variant:40s} {q:15s} predicted {p:8.3f} measured {m:8.3f} ({p / m - 1:+.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
