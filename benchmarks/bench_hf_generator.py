"""The built-in ``hf`` generator on the CPU demo's shape: the whole batch decoded together vs row by row.

    python benchmarks/bench_hf_generator.py            # 16 prompts x 8 samples x 8 new tokens, the demo's model

"row by row" decodes each of the 128 sequences alone (batches of one: what the generator did
before it batched), "batched" is ``generate`` on all of them. Greedy and sampled (temperature 1,
seeded), median of ``--repeats``; rows go to ``benchmarks/results.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_log  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    import torch

    from rlcore.loading.loader import build_config
    from rlcore.cli.demo import DEMO_MODEL
    from rlcore.generation.hf_generator import HFGenerator
    from rlcore.interfaces import SamplingParams
    from rlcore.testing.tiny import build_tiny_model

    torch.set_num_threads(2)
    path = build_tiny_model(Path(tempfile.mkdtemp()) / "model", "llama", seed=0, **DEMO_MODEL)
    config = build_config({"policy": {"model_name": str(path), "generation": {"backend": "hf"}}})
    gen = HFGenerator(str(path), config.section("policy.generation"), 128)
    prompts = [gen.tokenizer.encode(f"{a}+{a * 7 % 100}=", add_special_tokens=False) for a in range(args.prompts)]
    rows = []
    for temperature in (0.0, 1.0):
        params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, temperature=temperature, seed=0, ignore_eos=True)
        seeds = [1_000_003 * i + k for i in range(len(prompts)) for k in range(args.samples)]

        def row_by_row():
            return [gen._sample_one(prompts[i // args.samples], params, s) for i, s in enumerate(seeds)]

        timings = {}
        for name, fn in (("row by row", row_by_row), ("batched", lambda: gen.generate(prompts, params))):
            fn()  # warm-up
            runs = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - start)
            timings[name] = statistics.median(runs)
        tokens = len(seeds) * args.new_tokens
        for name, seconds in timings.items():
            rows.append({"variant": f"{name}, temperature {temperature}", "step_s": seconds, "tokens_per_s": tokens / seconds,
                         "speedup_vs_row_by_row": timings["row by row"] / seconds})
    print("| variant | seconds | tokens/s | x row by row |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['speedup_vs_row_by_row']:.1f} |")
    results_log.append(rows, bench="bench_hf_generator", gpus=0,
                       config=f"demo model, {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
