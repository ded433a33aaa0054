"""Throughput of math grading (rlcore-math): graded responses per second.

A thin caller of rlcore-math's component benchmark (``rlcore_math.benchmark.grading``), which
``rlcore bench component grading RECIPE`` runs with a recipe's settings:

    .venv/bin/python benchmarks/bench_grading.py [--workers 2] [--prompts 64] [--group 8] [--batches 8] [--style gsm8k|math]
"""

from __future__ import annotations

import argparse
import os


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

    import rlcore
    from rlcore_math.benchmark import grading

    math = {"executor": args.executor, "num_workers": args.workers, **({"chunk_size": args.chunk_size} if args.chunk_size else {})}
    config = rlcore.build_config({"policy": {"model_name": "unused"}, "env": {"name": "math", "math": math},
                                  "train": {"num_prompts_per_step": args.prompts},
                                  "grpo": {"num_generations_per_prompt": args.group}})
    row = grading(config, steps=args.batches + 1, warmup=1, style=args.style, seed=args.seed)
    print(f"style={args.style} executor={args.executor} workers={args.workers} batch={args.prompts}x{args.group} "
          f"mean response {row['mean_chars']:.0f} chars")
    print(f"graded {row['responses']:.0f} responses in {row['seconds']:.2f}s: {row['responses_per_s']:.0f} responses/s "
          f"(correct {row['correct_fraction']:.2f}); {row['responses_per_cpu_s']:.0f} responses per CPU-second; "
          f"load average during the run {open('/proc/loadavg').read().split()[0]} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
