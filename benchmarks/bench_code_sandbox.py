"""Grading throughput of the ``code`` environment: solutions per second through the bubblewrap sandbox pool.

Seeded ``code_tasks`` (5 hidden tests each), half answered right and half wrong, graded by
``CodeEnvironment.step`` with ``--workers`` sandboxes at a time; one sandbox per solution (start-up
included, which dominates). Prints a table and appends one row per worker count to
``benchmarks/results.jsonl`` (``solutions_per_s``, and the load average: other work on the cores slows it).

    python benchmarks/bench_code_sandbox.py --solutions 64 --workers 1 2
"""

from __future__ import annotations

import argparse
import os
import time

from results_log import append


def solutions(count: int):
    from rlcore_envs.code_tasks import generate
    from rlcore_envs.config import CodeTasksDatasetConfig

    train, _ = generate(CodeTasksDatasetConfig(num_train=count, num_validation=0, seed=0))
    responses = []
    for i, sample in enumerate(train):
        table = dict(zip([repr(a) for a in sample.answer["inputs"]], sample.answer["outputs"]))
        right = f"TABLE = {table!r}\ndef f(*args):\n    return TABLE[repr(list(args))]\n"
        responses.append([right if i % 2 == 0 else "def f(*args):\n    return None\n"])
    return train, responses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--solutions", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    args = parser.parse_args()
    from rlcore_envs.code_env import CodeEnvironment
    from rlcore_envs.config import CodeEnvConfig

    samples, responses = solutions(args.solutions)
    rows = []
    for workers in args.workers:
        env = CodeEnvironment(CodeEnvConfig(num_workers=workers))
        started = time.perf_counter()
        steps = env.step(samples, responses)
        seconds = time.perf_counter() - started
        env.close()
        passed = sum(s.metrics.get("correct", 0.0) for s in steps)
        assert passed == (len(samples) + 1) // 2, f"{passed} solutions passed, expected {(len(samples) + 1) // 2}"
        rows.append({"variant": f"{workers} workers", "solutions_per_s": len(samples) / seconds, "seconds": seconds,
                     "solutions": len(samples), "workers": workers, "load_average": os.getloadavg()[0]})
        print(f"{workers} workers: {len(samples)} solutions in {seconds:.1f}s = {len(samples) / seconds:.1f} solutions/s "
              f"({passed:.0f} right), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    append(rows, bench="bench_code_sandbox", config=f"{args.solutions} code_tasks solutions, 5 tests each, one bwrap sandbox each",
           gpus=0)


if __name__ == "__main__":
    main()
