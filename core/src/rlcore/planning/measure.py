"""``rlcore plan --calibrate``: a few seconds of measurements on this machine, written where the planner reads.

What is measured, and what it sets (scaling the shipped H200 values, which came from whole runs):

- a large GEMM's achieved share of the table's peak: the training, logprob, MoE and prefill efficiencies
  scale by it over :data:`GEMM_SHARE_REF` (the share a large bf16 GEMM reaches on the GPUs the rows came from);
- causal attention (``scaled_dot_product_attention``) at 4096 tokens: reported;
- a decode loop (a matrix-vector product per layer for 64 steps) and a 1 GiB copy: the memory-bandwidth
  efficiency of decode;
- with two or more GPUs, a 256 MiB copy between GPU 0 and 1: the collective efficiency over the link.

The per-step host cost of an engine is vLLM's scheduler, which this cannot time without an engine; it
stays the shipped value. On a machine without CUDA it measures the CPU (float32) and writes under "cpu".
"""

from __future__ import annotations

import json
import time

from rlcore.planning.calibration import load_calibration, user_calibration_path
from rlcore.planning.hardware import gpu as gpu_entry

GEMM_SHARE_REF = 0.75


def _timed(fn, repeats: int, sync) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def measure(device: str, *, n: int = 8192, seq: int = 4096) -> dict:
    import torch

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        n, seq = 512, 256
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = {"gemm_tflops": 2 * n**3 / _timed(lambda: a @ b, 5, sync) / 1e12}
    q = torch.randn(1, 32, seq, 128, device=device, dtype=dtype)
    attn = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), 3, sync)
    out["attention_tflops"] = 4 * 32 * 128 * seq * seq / 2 / attn / 1e12
    big = torch.empty(2**28 if cuda else 2**24, device=device, dtype=torch.float32)
    copy_s = _timed(lambda: big.clone(), 3, sync)
    out["copy_tbps"] = 2 * big.numel() * 4 / copy_s / 1e12
    weights = [torch.randn(n // 2, n // 2, device=device, dtype=dtype) for _ in range(4)]
    x = torch.randn(n // 2, 1, device=device, dtype=dtype)

    def decode_step():
        h = x
        for w in weights:
            h = w @ h
        return h

    step = _timed(decode_step, 64, sync)
    out["decode_tbps"] = sum(w.numel() * w.element_size() for w in weights) / step / 1e12
    if cuda and torch.cuda.device_count() > 1:
        src = torch.empty(2**26, device="cuda:0", dtype=torch.float32)
        peer = _timed(lambda: src.to("cuda:1"), 3, lambda: (torch.cuda.synchronize(0), torch.cuda.synchronize(1)))
        out["link_gbps"] = src.numel() * 4 / peer / 1e9
    return out


def calibrate(gpu_name: str) -> tuple:
    """Measure, derive the calibration values, merge them into the user's file; return (path, values)."""
    import torch

    cuda = torch.cuda.is_available()
    measured = measure("cuda" if cuda else "cpu")
    key = gpu_name if cuda else "cpu"
    values: dict = {"measured": {k: round(v, 4) for k, v in measured.items()}}
    if cuda:
        table = gpu_entry(gpu_name)
        shipped = load_calibration(gpu_name)
        scale = measured["gemm_tflops"] / table.peak_tflops / GEMM_SHARE_REF
        for name in ("train_efficiency", "eager_efficiency", "moe_efficiency", "fsdp2_moe_efficiency", "forward_efficiency", "prefill_efficiency"):
            values[name] = round(min(0.95, getattr(shipped, name) * scale), 4)
        values["decode_bandwidth_efficiency"] = round(min(0.95, max(measured["copy_tbps"], measured["decode_tbps"]) / table.hbm_tbps), 4)
        if "link_gbps" in measured:
            values["comm_efficiency"] = round(min(0.95, measured["link_gbps"] / table.link_gbps), 4)
    path = user_calibration_path()
    existing = json.loads(path.read_text()) if path.is_file() else {}
    existing[key] = values
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(existing, indent=1) + "\n")
    return path, values
