"""The planner's predictions for ``bench_train_megatron.py`` runs on one GPU, beside the command that measures them.

For checking on a GPU that a configuration the planner predicts to fit does, and one it predicts not to
fit does not (``peak_mem_gib`` of the row, or an out-of-memory error):

    python benchmarks/plan_check.py --shape qwen3moe --layers 10 11 12 --mb-tokens 8192
    python benchmarks/plan_check.py --shape 1b --mb-tokens 65536 73728 81920 --micro-batches 2
"""

from __future__ import annotations

import argparse
import itertools

import attrs

from rlcore.planning import fit, search
from rlcore.planning.calibration import load_calibration
from rlcore.planning.hardware import Cluster, gpu
from rlcore.planning.layout import Layout
from rlcore.planning.shapes import resolve_shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("1b", "8b", "qwen3moe"), default="1b")
    p.add_argument("--layers", type=int, nargs="*", default=[None])
    p.add_argument("--mb-tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--gpu", default="h200")
    args = p.parse_args()
    # the raw prediction against the whole GPU: no headroom, which is what a run on the GPU checks
    cal, cluster = attrs.evolve(load_calibration(args.gpu), headroom=0.0), Cluster(gpu(args.gpu), 1, 1)
    for layers, budget in itertools.product(args.layers, args.mb_tokens):
        shape = resolve_shape("", args.shape, layers if args.shape == "qwen3moe" else None)
        work = fit.training_alone(args.micro_batches * budget * 0.97)
        est = search.evaluate(shape, work, Layout(train_mb_tokens=budget), cluster, cal)
        mem = est.memory
        verdict = "fits" if mem.fits else "does not fit"
        command = (f"python benchmarks/bench_train_megatron.py --shape {args.shape}"
                   + (f" --layers {layers}" if layers else "") + f" --mb-tokens {budget} --micro-batches {args.micro_batches}"
                   + " --variants megatron --steps 2 --warmup 1")
        print(f"{shape.name}, {budget}-token micro-batches: predicted peak {mem.peak_gib:.1f} of {mem.limit_gib:.1f} GiB "
              f"({verdict}; largest: {mem.largest} {mem.parts[mem.largest]:.1f} GiB), step {est.phases['training']:.2f} s\n  {command}")


if __name__ == "__main__":
    main()
