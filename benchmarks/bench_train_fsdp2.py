"""Training throughput and MFU of the fsdp2 backend on a 1.2B Llama shape, packed micro-batches.

    python benchmarks/bench_train_fsdp2.py --steps 10                  # one H200: eager and torch.compile variants
    python benchmarks/bench_train_fsdp2.py --steps 10 --variants eager # only the eager one
    python benchmarks/bench_train_fsdp2.py --steps 4 --variants compile --micro-batches 16   # a 64k-token step
    python benchmarks/bench_train_fsdp2.py --tiny --steps 3            # CPU smoke run (tiny shape, fp32, eager)

On the GPU machines (nothing installed there): prefix ``PYTHONPATH=core/src:plugins/backend_fsdp2/src``.

Model: Llama-3.2-1B shape (hidden 2048, 16 layers, 32 query / 8 key-value heads, head_dim 64,
intermediate 8192, vocab 128256, tied embeddings), random-init from the config, built by the
backend itself (``FSDP2Backend(..., hf_config=...)``), fp32 master weights, bf16 compute,
fp32 gradient reduction, AdamW. Each optimizer step trains ``--micro-batches`` packed
micro-batches of at most ``--mb-tokens`` tokens (sequences of random length in
[``--min-len``, ``--max-len``], packed by rlcore's packer) with the registered ``sft`` loss
(``--algorithm grpo``: GRPO's clipped policy-gradient loss on random advantages).

MFU against ``--peak-tflops`` (989 = H200 dense bf16 datasheet)::

    FLOPs/step = 6 * N_matmul * T  +  6 * L * d_attn * sum_i len_i^2
    N_matmul   = parameters of all matmuls, LM head included (1.235e9 here; the embedding
                 lookup is not a matmul, and tying does not change the LM head's cost)
    T          = real (non-padding) tokens of the step
    d_attn     = num_heads * head_dim (2048); L = layers (16)

The attention term is the causal QK^T and AV products (2 matmuls x 2 FLOPs x d_attn x len^2/2
per layer forward, x3 for forward + backward) summed over the packed sequences, which attend
only within themselves. Timing: ``--warmup`` steps, then each step timed with a device
synchronize; medians are reported. A single-process ``torch.distributed`` group (NCCL on GPU,
gloo on CPU) is created here, as a trainer rank's caller would.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
from rlcore.utils import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_peak  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    p.add_argument("--micro-batches", type=int, default=4, help="packed micro-batches per optimizer step")
    p.add_argument("--mb-tokens", type=int, default=4096, help="token budget of a micro-batch")
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--variants", default=None,
                   help="comma-separated: eager, compile (per-layer torch.compile); default both on GPU, eager with --tiny")
    p.add_argument("--ac", action="store_true", help="activation checkpointing")
    p.add_argument("--algorithm", choices=["sft", "grpo"], default="sft",
                   help="loss: sft, or grpo (random advantages, old logprobs at log(1/vocab))")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--tiny", action="store_true", help="tiny shape on CPU in fp32 (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", metavar="DIR", help="profile 2 more steps: print tables, write DIR/<variant>.json.gz")
    p.add_argument("--memory-report", action="store_true",
                   help="one more step with the allocator's history recorded: print the tensors alive at its peak, by site")
    p.add_argument("--profile-no-stack", action="store_true",
                   help="profile without Python stacks: host timings closer to unprofiled ones, no 'host in' frames")
    return p.parse_args(argv)


def model_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           intermediate_size=256, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True)
    return LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                       intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True)


def matmul_params(cfg) -> int:
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer + cfg.vocab_size * h


def step_flops(cfg, lengths: list[int]) -> float:
    d_attn = cfg.num_attention_heads * cfg.head_dim
    return 6.0 * matmul_params(cfg) * sum(lengths) + 6.0 * cfg.num_hidden_layers * d_attn * sum(n * n for n in lengths)


def make_batch(args, vocab: int, gen: torch.Generator):
    """Random sequences filling about micro_batches x mb_tokens tokens (the packer bins them)."""
    from rlcore.interfaces import SequenceBatch

    budget = int(args.micro_batches * args.mb_tokens * 0.97)
    ids, masks = [], []
    while budget >= args.min_len:
        n = min(int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=gen)), budget)
        ids.append(torch.randint(3, vocab, (n,), generator=gen))
        masks.append(torch.ones(n))
        budget -= n
    batch = SequenceBatch(input_ids=ids, loss_mask=masks)
    if getattr(args, "algorithm", "sft") == "grpo":
        batch.seq_fields["advantages"] = torch.randn(len(ids), generator=gen)
        batch.token_fields["old_logprobs"] = [torch.full((len(x),), -math.log(vocab)) for x in ids]
    return batch


def init_single_process_group(device: str) -> None:
    if dist.is_initialized():
        return
    port = free_port()
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, **({"device_id": torch.device("cuda", 0)} if device == "cuda" else {}))


def build_backend(args, hf_config, device: str, compile_layers: bool):
    from rlcore.config.schema import OptimizerConfig, PolicyConfig, RunConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig, DTensorExperimentalConfig

    policy = PolicyConfig(
        model_name="<random-init>", precision="float32" if args.tiny else "bfloat16", max_grad_norm=1.0,
        optimizer=OptimizerConfig(lr=1e-5, weight_decay=0.01),
        sequence_packing=SequencePackingConfig(train_mb_tokens=args.mb_tokens, logprob_mb_tokens=args.mb_tokens))
    # Training alone: no colocated engine to hand cached memory to between steps.
    cfg = DTensorConfig(activation_checkpointing=args.ac, compile=compile_layers,
                        experimental=DTensorExperimentalConfig(empty_cache_after_train=False))
    config = RunConfig(policy=policy, sections={SECTION: cfg})
    return FSDP2Backend(config, cfg, WorldInfo(device=device), hf_config=hf_config, seed=args.seed)


def profile_steps(step, steps: int, out_dir: str, label: str, device: str, with_stack: bool = True) -> None:
    """Run ``step()`` ``steps`` times under torch.profiler; print where the time went.

    Prints wall time per step against the summed time of GPU kernels (a GPU idle most of the step
    points at host-side overhead or synchronization), the top operators by self device time and
    by self host time, and writes a gzipped Chrome trace to ``out_dir/<label>.json.gz``.
    """
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities, record_shapes=False, with_stack=with_stack) as prof:
        for _ in range(steps):
            step()
        sync(device)
    wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / steps if device == "cuda" else 0.0
    print(f"[profile {label}] wall {wall * 1e3:.1f} ms/step, GPU kernels {device_us / 1e3:.1f} ms/step "
          f"({100 * device_us / 1e6 / wall:.0f}% busy)", flush=True)
    if device == "cuda":
        print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70), flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70), flush=True)
    if with_stack:
        by_stack = prof.key_averages(group_by_stack_n=6)
        print(by_stack.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    raw = os.path.join(out_dir, f"{label}.json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)


def host_speed_us() -> float:
    """Microseconds per small eager torch op on this host (median of 5 rounds of 2,000 ``add``s on
    a 1-element CPU tensor): the lent GPU machines differ in host speed, and a step the host
    bounds moves with it, so the rows of different machines compare only with this next to them."""
    x = torch.zeros(1)
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            x = x + 1
        rounds.append((time.perf_counter() - start) / 2000 * 1e6)
    return statistics.median(rounds)


def memory_fields(device: str) -> dict:
    """The allocator's view of the steps just run (GiB): ``peak_mem_gib`` the tensors' peak, ``peak_reserved_gib``
    what the allocator held from the device at its peak (the tensors plus cached blocks none of them could reuse),
    ``state_mem_gib`` the tensors still allocated after the last step (weights, gradients, optimizer state)."""
    if device != "cuda":
        return {"peak_mem_gib": float("nan"), "peak_reserved_gib": float("nan"), "state_mem_gib": float("nan")}
    return {"peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "state_mem_gib": torch.cuda.memory_allocated() / 2**30}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(args, name: str, hf_config, device: str) -> dict:
    from rlcore.algorithms.grpo import GRPO
    from rlcore.algorithms.sft import SFT

    t0 = time.perf_counter()
    backend = build_backend(args, hf_config, device, compile_layers=(name == "compile"))
    build_s = time.perf_counter() - t0
    algo, gen = (GRPO() if args.algorithm == "grpo" else SFT()), torch.Generator().manual_seed(args.seed)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, tokens, flops, mbs = [], [], [], []
    for step in range(args.warmup + args.steps):
        batch = make_batch(args, hf_config.vocab_size, gen)
        sync(device)
        start = time.perf_counter()
        metrics = backend.train(batch, algo)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            tokens.append(sum(batch.lengths()))
            flops.append(step_flops(hf_config, batch.lengths()))
            mbs.append(metrics["num_micro_batches"])
        if not all(v == v for v in metrics.values()):
            raise RuntimeError(f"non-finite metrics at step {step}: {metrics}")
    if args.profile:
        profile_steps(lambda: backend.train(make_batch(args, hf_config.vocab_size, gen), algo), 2, args.profile, name, device,
                      with_stack=not args.profile_no_stack)
    if args.memory_report and device == "cuda":
        print(f"[memory {name}]\n" + memory_peak.record(lambda: backend.train(make_batch(args, hf_config.vocab_size, gen), algo)))
    med = statistics.median(times)
    i = times.index(med) if med in times else 0
    result = {
        "variant": name, "build_s": build_s, "step_s": med, "tokens_per_step": tokens[i],
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
        "tflops": statistics.median(f / s for f, s in zip(flops, times)) / 1e12,
        "micro_batches": statistics.median(mbs),
        **memory_fields(device),
        "last_loss": metrics["loss"],
    }
    result["mfu"] = result["tflops"] / args.peak_tflops
    backend.shutdown()
    del backend
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    variants = (args.variants or ("eager" if args.tiny else "eager,compile")).split(",")
    unknown = set(variants) - {"eager", "compile"}
    if unknown:
        print(f"unknown variant(s) {sorted(unknown)}; choose from eager, compile", file=sys.stderr)
        return 2
    if device == "cpu" and not args.tiny:
        print("no CUDA device: use --tiny for the CPU smoke run", file=sys.stderr)
        return 2
    if args.tiny:
        args.mb_tokens, args.min_len, args.max_len = min(args.mb_tokens, 256), min(args.min_len, 16), min(args.max_len, 128)
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    init_single_process_group(device)
    hf_config = model_config(args.tiny)
    print(f"device={device} torch={torch.__version__} N_matmul={matmul_params(hf_config):,} "
          f"micro-batches/step={args.micro_batches} x {args.mb_tokens} tokens, lengths [{args.min_len}, {args.max_len}], loss {args.algorithm}, "
          f"host: {host_speed_us():.2f} us per small eager op")
    rows = []
    for name in variants:
        try:
            rows.append(run_variant(args, name, hf_config, device))
        except Exception:  # noqa: BLE001 - report and go on with the other variant
            print(f"variant {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
    print("| variant | step (s) | tokens/step | micro-batches | tokens/s | TFLOP/s | MFU | peak mem (GiB) | build (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['step_s']:.3f} | {r['tokens_per_step']} | {r['micro_batches']:.0f} | {r['tokens_per_s']:,.0f} "
              f"| {r['tflops']:.1f} | {100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.1f} | {r['build_s']:.1f} |")
    dist.destroy_process_group()
    return 0 if len(rows) == len(variants) else 1


if __name__ == "__main__":
    sys.exit(main())
