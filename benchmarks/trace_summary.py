"""Summarize a torch.profiler Chrome trace (``--profile`` of the training benchmarks).

    python benchmarks/trace_summary.py /path/megatron.json.gz [--top 30]

Prints: the span of the trace and how much of it had a GPU kernel running (union of kernel
intervals), the longest GPU-idle gaps with the Python function that was running on the host at
the time, the CUDA runtime calls that block the host (synchronizations, blocking copies), and the
Python functions with the largest inclusive host time. torch.profiler's own tables give per-operator
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    events = load(args.trace)
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op", "user_annotation")]
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
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

    runtime = collections.Counter()
    runtime_n = collections.Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime":
            runtime[e["name"]] += e["dur"]
            runtime_n[e["name"]] += 1
    print("\nCUDA runtime calls by host time:")
    for name, us in runtime.most_common(10):
        print(f"  {us / 1e3:9.2f} ms  x{runtime_n[name]:<6d} {name}")

    inclusive = collections.Counter()
    calls = collections.Counter()
    for e in host:
        if e.get("cat") == "python_function":
            inclusive[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    print("\nPython functions by inclusive host time (nested calls counted in their callers too):")
    for name, us in inclusive.most_common(args.top):
        print(f"  {us / 1e3:9.2f} ms  x{calls[name]:<6d} {name[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
