"""GPU time of :func:`rlcore.training.ops.token_logprobs` (forward and backward) on one micro-batch's logits.

    python benchmarks/bench_logprobs.py                        # one H200: 4096 x 128256 bf16, chunks of 1024
    python benchmarks/bench_logprobs.py --tokens 3952 --chunk-tokens 4096
    python benchmarks/bench_logprobs.py --device cpu --tokens 64 --vocab 512 --reps 2   # smoke run

On the GPU machines: prefix ``PYTHONPATH=core/src``. Each pass runs
``--reps`` calls after ``--warmup`` calls (compiles happen there): the median wall time of a call
and, on CUDA, its GPU kernel time from the profiler, with the bandwidth that implies. The
forward reads the logits once, the backward reads them and writes their gradient (the least any
implementation must move; the logsumexp per row and the targets are negligible).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rlcore.training.ops import token_logprobs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="rows of the logits (one packed micro-batch)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--sequences", type=int, default=4, help="equal-length sequences packed in the rows")
    p.add_argument("--eager", action="store_true", help="the eager chunk functions instead of the compiled ones")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


def timed(fn, reps: int, device: torch.device) -> tuple[float, float | None]:
    """(median wall seconds of one ``fn()`` call, its GPU kernel seconds or None on CPU).

    Wall time includes the host's launch overhead (each call starts on an idle GPU); the kernel
    time is what the call costs inside a training step, where the host runs ahead of the GPU."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    if device.type != "cuda":
        return statistics.median(times), None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    return statistics.median(times), kernel_us / 1e6 / reps


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    logits_TV = torch.randn(args.tokens, args.vocab, device=device, dtype=dtype, generator=g).requires_grad_()
    ids_T = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=g)
    cu = torch.linspace(0, args.tokens, args.sequences + 1).long()  # on the host, as the backends keep it
    grad_T = torch.randn(args.tokens, device=device, generator=g)

    def forward():
        return token_logprobs(logits_TV, ids_T, cu, chunk_tokens=args.chunk_tokens, fused=not args.eager)

    def forward_backward():
        logits_TV.grad = None
        forward().backward(grad_T)

    for _ in range(args.warmup):
        forward_backward()
    with torch.no_grad():
        fwd = timed(forward, args.reps, device)
    both = timed(forward_backward, args.reps, device)
    size = logits_TV.numel() * logits_TV.element_size()
    print(f"token_logprobs {args.tokens} x {args.vocab} {str(dtype).removeprefix('torch.')}, chunks of "
          f"{args.chunk_tokens}, {'eager' if args.eager else 'compiled'} on {device.type}")
    print("| pass | wall (ms) | GPU kernels (ms) | GB moved | GB/s in the kernels |")
    print("|---|---:|---:|---:|---:|")
    rows = [("forward", fwd, size), ("forward + backward", both, 3 * size)]
    for name, (wall, kernels), moved in rows:
        gpu = f"{kernels * 1e3:.3f} | {moved / 1e9:.2f} | {moved / kernels / 1e9:,.0f}" if kernels else f"- | {moved / 1e9:.2f} | -"
        print(f"| {name} | {wall * 1e3:.3f} | {gpu} |")


if __name__ == "__main__":
    main()
