"""Component benchmark of rlcore-math (``rlcore bench component grading RECIPE``): graded responses per second.

Synthetic GSM8K-length responses (6 worked steps, ~750 characters, ending in '#### n' or
'\\boxed{n}', half of them right; ``style="math"``: ending in a LaTeX fraction to compare by
value), in GRPO-shaped batches: P prompts x G samples (the recipe's ``grpo`` section), the G samples
of a prompt sharing its ground truth, graded by the recipe's ``env.math`` grading settings
(executor, workers). Numbers are drawn fresh for every response, so that no cache sees the same
text twice. Worker start-up is not counted: the first batch warms the grader.
"""

from __future__ import annotations

import os
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


def grading(config, steps: int, warmup: int, style: str = "gsm8k", seed: int = 0) -> dict[str, float]:
    """``steps`` batches graded, the first ``warmup`` left out; responses per second and per CPU-second."""
    from rlcore_math.config import MathEnvConfig
    from rlcore_math.pool import make_grader

    section = config.section("env.math") or MathEnvConfig()
    rng = random.Random(seed)
    prompts, group = config.train.num_prompts_per_step, config.grpo.num_generations_per_prompt
    batches = [make_batch(rng, prompts, group, style) for _ in range(max(steps, warmup + 1))]
    grader = make_grader(section)
    try:
        for responses, golds in batches[: max(warmup, 1)]:
            grader.grade(responses, golds)  # worker start-up and imports are not counted
        pids = [w.process.pid for w in getattr(grader, "_workers", [])]
        cpu_started, started = cpu_seconds(pids), time.perf_counter()
        graded = correct = 0
        for responses, golds in batches[max(warmup, 1):]:
            for verdict in grader.grade(responses, golds):
                graded, correct = graded + 1, correct + verdict.correct
        seconds, cpu = time.perf_counter() - started, cpu_seconds(pids) - cpu_started
    finally:
        grader.close()
    return {"responses": float(graded), "seconds": seconds, "responses_per_s": graded / seconds if seconds else None,
            "responses_per_cpu_s": graded / cpu if cpu else None, "correct_fraction": correct / graded if graded else None,
            "mean_chars": sum(len(r) for r in batches[0][0]) / len(batches[0][0])}
