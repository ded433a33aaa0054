"""Summarize a torch.profiler Chrome trace (``--profile`` of the training benchmarks).

    python benchmarks/trace_summary.py /path/megatron.json.gz [--top 30]

Prints: the span of the trace and how much of it had a GPU kernel running (union of kernel
intervals), the longest GPU-idle gaps with the Python function that was running on the host at
the time, the CUDA runtime calls that block the host (synchronizations, blocking copies), and the
Python functions with the largest inclusive host time, how far the host runs ahead of the GPU,
and the GPU time of the kernels by kernel
class (GEMM, attention, Triton, NCCL, other) and by the innermost ``record_function`` region that
launched them (FSDP's ``FSDP::*`` hooks, ``Optimizer.step#*``, ...). Caveat with torch 2.11: the Python
events of torch's varlen attention ops (``_varlen_attn``, ``apply of FunctionMeta``) carry
durations far longer than the calls took; read past those rows. torch.profiler's own tables give per-operator
totals but not *where the GPU waits*, which is what a step dominated by host overhead needs.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in data["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def print_totals(title: str, events: list[dict], category: str, top: int, width: int) -> None:
    """Summed duration and count per event name of one trace category, largest first."""
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == category:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    print("\n" + title)
    for name, us in total.most_common(top):
        print(f"  {us / 1e3:9.2f} ms  x{count[name]:<6d} {name[:width]}")


KERNEL_CLASSES = (("attention", ("flash", "fmha", "attn")), ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas")),
                  ("triton", ("triton",)), ("nccl", ("nccl",)), ("memcpy/memset", ("memcpy", "memset")))


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def launch_times(events: list[dict]) -> dict[int, float]:
    """Host start time of each CUDA runtime call, by correlation id (kernels carry the same id)."""
    return {e["args"]["correlation"]: e["ts"] for e in events
            if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}


def print_host_lead(events: list[dict], launches: dict[int, float]) -> None:
    """How far ahead of the GPU the host launches: per kernel, its start minus its launch call's
    start. Kernels that start within 50 us of their launch found the GPU idle, waiting for the
    host; a host that runs ahead shows leads of milliseconds."""
    leads = sorted(e["ts"] - launches[e["args"]["correlation"]] for e in events
                   if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launches)
    if not leads:
        return
    waiting = sum(1 for lead in leads if lead < 50)
    print(f"\nhost lead over the GPU (kernel start - launch): median {leads[len(leads) // 2] / 1e3:.2f} ms, "
          f"90th percentile {leads[int(0.9 * (len(leads) - 1))] / 1e3:.2f} ms; {100 * waiting / len(leads):.0f}% "
          f"of {len(leads)} kernels started within 50 us of their launch (the GPU was waiting for the host)")


def print_kernel_attribution(events: list[dict], launches: dict[int, float], top: int) -> None:
    """GPU time per (launching region, kernel class): kernels are matched to their launch on the
    host by correlation id, the launch to the innermost enclosing user annotation."""
    regions = sorted((e for e in events if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in regions]
    by_class, by_region = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        cls = "memcpy/memset" if e["cat"] != "kernel" else kernel_class(e["name"])
        by_class[cls] += e["dur"]
        t = launches.get(e.get("args", {}).get("correlation"))
        region = "(no region)"
        if t is not None:
            i = bisect.bisect_right(starts, t)
            for r in reversed(regions[max(0, i - 3000):i]):
                if r["ts"] + r["dur"] >= t:
                    region = r["name"]
                    break
        # per-layer FSDP regions (FSDP::post_backward_reduce (model.layers.3)) summed per kind
        by_region[(region.split(" (")[0], cls)] += e["dur"]
    print("\nGPU time by kernel class:")
    for cls, us in by_class.most_common():
        print(f"  {us / 1e3:9.2f} ms  {cls}")
    print("GPU time by launching region and kernel class:")
    for (region, cls), us in by_region.most_common(top):
        print(f"  {us / 1e3:9.2f} ms  {cls:<14s} {region[:120]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    events = load(args.trace)
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op", "user_annotation")]
    timed = [e for e in events if e.get("cat") in ("cpu_op", "kernel")]
    start = min(e["ts"] for e in timed)
    end = max(e["ts"] + e["dur"] for e in timed)

    busy = union(kernels)
    busy_us = sum(b - a for a, b in busy)
    print(f"trace span {((end - start) / 1e3):.1f} ms; GPU busy {busy_us / 1e3:.1f} ms "
          f"({100 * busy_us / max(end - start, 1):.0f}%) in {len(kernels)} kernels/copies")

    # GPU-idle gaps, longest first, with the innermost Python frame open at the gap's middle.
    py = sorted((e for e in events if e.get("cat") == "python_function"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in py]
    gaps = [(b2 - a1, a1, b2) for (_, a1), (b2, _) in zip(busy[:-1], busy[1:]) if b2 > a1]
    gaps.sort(reverse=True)
    print(f"\nlongest GPU-idle gaps (total idle between kernels {sum(g for g, _, _ in gaps) / 1e3:.1f} ms):")
    for gap, a, b in gaps[: args.top // 2]:
        mid = (a + b) / 2
        i = bisect.bisect_right(starts, mid)
        stack = [e["name"] for e in py[max(0, i - 4000):i] if e["ts"] + e["dur"] >= mid]
        where = " <- ".join(reversed(stack[-3:])) if stack else "?"
        print(f"  {gap / 1e3:8.2f} ms at +{(a - start) / 1e3:8.1f} ms  host in: {where[:160]}")

    launches = launch_times(events)
    print_host_lead(events, launches)
    print_kernel_attribution(events, launches, args.top)
    print_totals("CUDA runtime calls by host time:", events, "cuda_runtime", 10, 200)
    print_totals("Python functions by inclusive host time (nested calls counted in their callers too):", host,
                 "python_function", args.top, 150)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
