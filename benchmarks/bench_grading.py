"""Throughput of math grading (rlcore-math): graded responses per second.

Synthetic GSM8K-length responses (6 worked steps, ~750 characters, ending in '#### n' or
'\\boxed{n}', half of them right; ``--style math``: ending in a LaTeX fraction to compare by
value), in GRPO-shaped batches: P prompts x G samples, the G samples of a prompt sharing its
ground truth. Numbers are drawn fresh for every response, so that no cache sees the same text
twice.

    .venv/bin/python benchmarks/bench_grading.py [--workers 2] [--prompts 64] [--group 8] [--batches 8] [--style gsm8k|math]
"""

from __future__ import annotations

import argparse
import random
import time


def make_response(rng: random.Random, gold: int, right: bool, style: str) -> str:
    lines = []
    total = 0
    names = ["apples", "pencils", "dollars", "minutes", "pages", "marbles", "cookies", "stickers"]
    for step in range(6):
        a, b = rng.randrange(2, 500), rng.randrange(2, 60)
        op = rng.choice(["+", "*", "-"])
        value = a + b if op == "+" else a * b if op == "*" else a - b
        total += value
        lines.append(f"Step {step + 1}: she has {a} {rng.choice(names)} and gets {b} more per day, "
                     f"so {a} {op} {b} = <<{a}{op}{b}={value}>>{value} {rng.choice(names)} in this part.")
    lines.append(f"Adding the parts up and checking the arithmetic once more gives the final count.")
    answer = gold if right else gold + rng.randrange(1, 9)
    if style == "math":  # a LaTeX fraction answer, equal in value to the gold but written differently
        lines.append(f"So the probability is $\\boxed{{\\frac{{{2 * answer}}}{{{2 * (answer + 7)}}}}}$.")
    else:
        lines.append(f"#### {answer}" if rng.random() < 0.5 else f"The answer is $\\boxed{{{answer}}}$.")
    return "\n".join(lines)


def cpu_seconds(pids: list[int]) -> float:
    """User+system CPU seconds of this process and the given ones (Linux /proc)."""
    import os

    total = time.process_time()
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, IndexError, ValueError):
            pass
    return total


def make_batch(rng: random.Random, prompts: int, group: int, style: str) -> tuple[list[str], list[str]]:
    responses, golds = [], []
    for _ in range(prompts):
        gold = rng.randrange(10, 100_000)
        for _ in range(group):
            responses.append(make_response(rng, gold, rng.random() < 0.5, style))
            golds.append(f"\\frac{{{gold}}}{{{gold + 7}}}" if style == "math" else str(gold))
    return responses, golds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--executor", default="process", choices=["process", "inline", "ray"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-size", type=int, default=None, help="responses per worker message (default: the config's)")
    parser.add_argument("--style", default="gsm8k", choices=["gsm8k", "math"],
                        help="gsm8k: integer answers ('#### n' or \\boxed{n}); math: LaTeX fractions compared by value")
    args = parser.parse_args()

    from rlcore_math.config import GradingConfig
    from rlcore_math.pool import make_grader

    rng = random.Random(args.seed)
    batches = [make_batch(rng, args.prompts, args.group, args.style) for _ in range(args.batches + 1)]
    chars = sum(len(r) for r in batches[0][0]) / len(batches[0][0])
    extra = {"chunk_size": args.chunk_size} if args.chunk_size else {}
    grader = make_grader(GradingConfig(executor=args.executor, num_workers=args.workers, **extra))
    try:
        warm = grader.grade(*batches[0])  # worker start-up and imports are not counted
        expected = sum(v.correct for v in warm)
        pids = [w.process.pid for w in getattr(grader, "_workers", [])]
        cpu_started = cpu_seconds(pids)
        started = time.perf_counter()
        graded = correct = 0
        statuses: dict[str, int] = {}
        for responses, golds in batches[1:]:
            for verdict in grader.grade(responses, golds):
                graded += 1
                correct += verdict.correct
                statuses[verdict.status] = statuses.get(verdict.status, 0) + 1
        seconds = time.perf_counter() - started
        cpu = cpu_seconds(pids) - cpu_started
    finally:
        grader.close()
    print(f"style={args.style} executor={args.executor} workers={args.workers} batch={args.prompts}x{args.group} "
          f"mean response {chars:.0f} chars")
    print(f"graded {graded} responses in {seconds:.2f}s: {graded / seconds:.0f} responses/s "
          f"(correct {correct / graded:.2f}, statuses {statuses}, warm-up batch correct {expected})")
    load = open("/proc/loadavg").read().split()[0]
    print(f"CPU time {cpu:.2f}s (parent + workers): {graded / cpu:.0f} responses per CPU-second; "
          f"load average during the run {load} on {__import__('os').cpu_count()} cores")


if __name__ == "__main__":
    main()
