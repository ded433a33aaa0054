"""The decode GEMMs of vLLM's FP8 rollouts, kernel by kernel: which FP8 GEMM is fastest at decode batch size.

At 256 sequences a decode step multiplies a (256, K) activation by every weight of the model once. This
times one GEMM of each projection of the 8B (or 1.2B) Llama shape, in bf16 and through each FP8 kernel
vLLM can dispatch to on Hopper, so that the generation benchmark's FP8 ratio can be read against what
the kernels allow:

- ``bf16``: ``F.linear`` (cuBLAS), what the bf16 engine runs;
- ``cutlass``: ``vllm._custom_ops.cutlass_scaled_mm``, per-token activation and per-tensor weight
  scales, what vLLM's online ``fp8`` runs on Hopper (``CutlassFP8ScaledMMLinearKernel``);
- ``torch-rowwise``: ``torch._scaled_mm`` with the same scales fused (PyTorch's row-wise path);
- ``torch-tensor``: ``torch._scaled_mm`` with one scale each (cuBLASLt), what vLLM would run with
  per-tensor activation scales;
- ``torch-fp32-dq``: ``torch._scaled_mm`` to fp32, then the scales applied (vLLM's
  ``ChannelWiseTorchFP8ScaledMMLinearKernel``, the ``fp8-kv-torchmm`` bench row);
- ``cutlass-block``: ``cutlass_scaled_mm`` with 128x128 weight blocks and 1x128 activation groups
  (``fp8_per_block``);
- ``quant-token``: the per-token activation quantization each FP8 GEMM needs (``scaled_fp8_quant``).

Each is captured in a CUDA graph (as vLLM's decode step is) and replayed over copies of the weight
that together exceed the L2 cache, so every call reads its weight from HBM. Median of ``--repeats``
graph replays; rows go to ``benchmarks/results.jsonl``. CUDA and vLLM only.

    python benchmarks/bench_fp8_gemm.py --shape 8b --tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_log  # noqa: E402

# projection -> (N, K) of the weight, nn.Linear layout
SHAPES = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "1.2b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}
LAYERS = {"8b": 32, "1.2b": 16}
KERNELS = ("bf16", "cutlass", "torch-rowwise", "torch-tensor", "torch-fp32-dq", "cutlass-block", "quant-token")
FP8_MAX = 448.0


def _weights(n: int, k: int, copies: int):
    """``copies`` weights in bf16 and their FP8 forms: per-tensor, per-channel and 128x128-block scales."""
    import torch

    out = []
    for _ in range(copies):
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        s_t = w.abs().amax().float() / FP8_MAX
        s_c = w.abs().amax(dim=1, keepdim=True).float() / FP8_MAX  # (N, 1)
        blocks = w.float().view(n // 128, 128, k // 128, 128)
        s_b = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # (N/128, K/128)
        out.append({
            "bf16": w, "t": (w.float() / s_t).to(torch.float8_e4m3fn), "s_t": s_t.reshape(1, 1),
            "c": (w.float() / s_c).to(torch.float8_e4m3fn), "s_c": s_c,
            "b": (blocks / s_b[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn), "s_b": s_b,
        })
    return out


def _call(kernel: str, x, xq, sx, xg, sg, w):
    """One GEMM (or the quantization) of ``kernel``; xq/sx per-token FP8, xg/sg 1x128-group FP8."""
    import torch
    from vllm import _custom_ops as ops

    if kernel == "bf16":
        return torch.nn.functional.linear(x, w["bf16"])
    if kernel == "cutlass":
        return ops.cutlass_scaled_mm(xq, w["t"].t(), scale_a=sx, scale_b=w["s_t"], out_dtype=torch.bfloat16)
    if kernel == "torch-rowwise":
        return torch._scaled_mm(xq, w["c"].t(), scale_a=sx, scale_b=w["s_c"].t(), out_dtype=torch.bfloat16)
    if kernel == "torch-tensor":
        return torch._scaled_mm(xq, w["t"].t(), scale_a=sx[:1, :1].reshape(()), scale_b=w["s_t"].reshape(()),
                                out_dtype=torch.bfloat16)
    if kernel == "torch-fp32-dq":
        one = torch.ones(1, dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(xq, w["c"].t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (y * sx * w["s_c"].t()).to(torch.bfloat16)
    if kernel == "cutlass-block":
        return ops.cutlass_scaled_mm(xg, w["b"].t(), scale_a=sg, scale_b=w["s_b"].t(), out_dtype=torch.bfloat16)
    if kernel == "quant-token":
        return ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)[0]
    raise ValueError(f"unknown kernel {kernel!r}")


def time_kernel(kernel: str, m: int, n: int, k: int, copies: int, calls: int, repeats: int) -> float:
    """Microseconds a call, from CUDA-graph replays of ``calls`` calls cycling over ``copies`` weights."""
    import torch
    from vllm import _custom_ops as ops

    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    xq, sx = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)  # (M, K) fp8, (M, 1) fp32
    g = x.float().view(m, k // 128, 128)
    sg_rows = g.abs().amax(dim=2) / FP8_MAX  # (M, K/128)
    xg = (g / sg_rows[..., None]).view(m, k).to(torch.float8_e4m3fn)
    sg = sg_rows.t().contiguous().t()  # column-major, as vLLM's block kernel takes them
    ws = _weights(n, k, copies)
    for w in ws:  # warm-up outside the graph (kernel selection, autotuning)
        _call(kernel, x, xq, sx, xg, sg, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            _call(kernel, x, xq, sx, xg, sg, ws[i % copies])
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end) / calls)
    del graph, ws
    torch.cuda.empty_cache()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="256", help="comma list of M (sequences in the decode batch)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    parser.add_argument("--calls", type=int, default=64, help="GEMMs per graph replay")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm.py needs a CUDA device (FP8 GEMMs)")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        per_step = {}
        for kernel in args.kernels.split(","):
            total, cells = 0.0, []
            for proj, (n, k) in SHAPES[args.shape].items():
                copies = max(2, -(-4 * l2 // (n * k)))  # FP8 copies past 4x the L2 (bf16: 8x)
                try:
                    us = time_kernel(kernel, m, n, k, copies, args.calls, args.repeats)
                except Exception as err:  # a kernel this build or device lacks: say so, time the rest
                    print(f"{kernel} {proj} M={m}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                    us = float("nan")
                total += us
                cells.append(f"{proj} {us:.1f}")
                rows.append({"variant": f"{kernel}-{proj}", "shape": args.shape, "tokens": m, "kernel": kernel, "projection": proj,
                             "n": n, "k": k, "us_per_call": round(us, 2)})
            per_step[kernel] = total * LAYERS[args.shape] / 1000.0
            print(f"| {args.shape} | M={m} | {kernel} | {' | '.join(cells)} | {per_step[kernel]:.2f} ms a step |", flush=True)
        for kernel, ms in per_step.items():
            rows.append({"variant": f"{kernel}-step", "shape": args.shape, "tokens": m, "kernel": kernel, "projection": "all layers",
                         "ms_per_step": round(ms, 3), "vs_bf16": round(per_step.get("bf16", float("nan")) / ms, 3)})
    results_log.append(rows, bench="bench_fp8_gemm", config=f"{args.shape}-decode-gemms", gpus=1)


if __name__ == "__main__":
    main()
