"""Packing efficiency and speed of ``rlcore.data.packing.plan_micro_batches`` on a realistic length mix.

Lengths are drawn log-normally (median ~400 tokens) and clipped to [16, 4096]. Reported per
token budget and data-parallel size: slot fill (real tokens / (micro-batches x budget), counting
every rank's micro-batches, empty ones included), micro-batches per rank, and planning time (best
of ``--repeats``). Also times ``make_micro_batches`` (the tensor layout of one rank) on a smaller
batch. Usage::

    .venv/bin/python benchmarks/bench_packing.py [--n 100000] [--repeats 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def lognormal_lengths(n: int, seed: int, low: int = 16, high: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=6.0, sigma=1.0, size=n), low, high).astype(np.int64)


def bench_plan(lengths: np.ndarray, max_tokens: int, dp_size: int, repeats: int) -> dict:
    from rlcore.data.packing import plan_micro_batches

    best, plan = float("inf"), None
    as_list = lengths.tolist()
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_micro_batches(as_list, max_tokens, dp_size)
        best = min(best, time.perf_counter() - start)
    per_rank = len(plan[0])
    fill = lengths.sum() / (per_rank * dp_size * max_tokens)
    return {"max_tokens": max_tokens, "dp": dp_size, "micro_batches_per_rank": per_rank, "fill": fill, "seconds": best}


def bench_layout(n: int, max_tokens: int, seed: int) -> float:
    import torch

    from rlcore.interfaces import SequenceBatch
    from rlcore.data.packing import make_micro_batches

    lengths = lognormal_lengths(n, seed).tolist()
    batch = SequenceBatch(
        input_ids=[torch.ones(length, dtype=torch.int64) for length in lengths],
        loss_mask=[torch.ones(length) for length in lengths],
        token_fields={k: [torch.zeros(length) for length in lengths] for k in ("advantages", "old_logprobs")},
        seq_fields={"rewards": torch.zeros(n)},
    )
    start = time.perf_counter()
    make_micro_batches(batch, max_tokens, pad_to_multiple=8)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="sequences")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lengths = lognormal_lengths(args.n, args.seed)
    print(f"{args.n} sequences, lengths log-normal in [16, 4096]: mean {lengths.mean():.0f}, "
          f"median {np.median(lengths):.0f}, total {lengths.sum()} tokens")
    print(f"{'max_tokens':>10} {'dp':>3} {'mb/rank':>8} {'fill':>8} {'plan s':>8}")
    for max_tokens in (4096, 8192, 16384):
        for dp in (1, 8):
            r = bench_plan(lengths, max_tokens, dp, args.repeats)
            print(f"{r['max_tokens']:>10} {r['dp']:>3} {r['micro_batches_per_rank']:>8} {r['fill']:>8.2%} {r['seconds']:>8.3f}")
    n_layout = 2048
    seconds = bench_layout(n_layout, 16384, args.seed)
    print(f"make_micro_batches (layout of {n_layout} sequences, 16384-token budget): {seconds:.3f} s")


if __name__ == "__main__":
    main()
