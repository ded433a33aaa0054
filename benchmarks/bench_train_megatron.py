"""Training throughput and MFU of the megatron backend (and fsdp2 in the same run), packed micro-batches.

    python benchmarks/bench_train_megatron.py --steps 10                    # one H200: 1.2B Llama shape, bf16
    python benchmarks/bench_train_megatron.py --steps 10 --with-fsdp2       # + the fsdp2 backend, same batches
    python benchmarks/bench_train_megatron.py --shape 8b --tp 2 --with-fsdp2 --steps 5   # 2 GPUs (nvidia-h200-x2)
    python benchmarks/bench_train_megatron.py --shape 8b --gpus 2 --with-fsdp2           # Megatron DP=2, as fsdp2
    python benchmarks/bench_train_megatron.py --tiny --steps 3              # CPU smoke run (tiny shape, fp32)

Models (random init from the config, built by the backend itself: ``MegatronBackend(...,
hf_config=...)``): ``1b`` = Llama-3.2-1B shape (hidden 2048, 16 layers, GQA 32/8, head_dim 64,
intermediate 8192, vocab 128256, tied embeddings); ``8b`` = Llama-3.1-8B shape (hidden 4096, 32
layers, GQA 32/8, intermediate 14336, vocab 128256, untied). bf16 parameters, fp32 main weights
and gradient reduction in Megatron's distributed optimizer, AdamW, the SDPA core attention of
the local layer spec (no Transformer Engine on these machines). Each optimizer step trains
``--micro-batches`` packed micro-batches of at most ``--mb-tokens`` tokens per data-parallel rank
(random lengths in [``--min-len``, ``--max-len``], rlcore's packer) with the registered ``sft``
loss. ``--gpus N`` (default ``--tp``) spawns N processes, one per GPU, unless launched by
torchrun; Megatron runs TP=``--tp`` and DP=N/tp, fsdp2 data-parallel over the same GPUs on the
same global batches. ``--profile DIR`` profiles two more steps (see ``trace_summary.py``).

MFU against ``--peak-tflops`` (989 = H200 dense bf16 datasheet), the same formula as
bench_train_fsdp2.py::

    FLOPs/step = 6 * N_matmul * T  +  6 * L * d_attn * sum_i len_i^2     (T = real tokens)
    MFU        = FLOPs/step / step time / (peak x number of GPUs)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_fsdp2 as common  # noqa: E402  (model shapes, FLOP formula, batch maker)
from rlcore.utils import free_port


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    p.add_argument("--micro-batches", type=int, default=4, help="packed micro-batches per optimizer step per DP rank")
    p.add_argument("--mb-tokens", type=int, default=4096, help="token budget of a micro-batch")
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--shape", choices=("1b", "8b"), default="1b")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--gpus", type=int, default=None, help="processes/GPUs (default: --tp); Megatron's DP = gpus / tp")
    p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism (with --tp > 1)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing (full recompute)")
    p.add_argument("--with-fsdp2", action="store_true", help="also run the fsdp2 backend on the same batches")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--tiny", action="store_true", help="tiny shape on CPU in fp32 (smoke test)")
    p.add_argument("--bf16", action="store_true", help="with --tiny: bf16 as on GPU (checks that code path on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", metavar="DIR", help="profile 2 more steps (rank 0): print tables, write DIR/<variant>.json.gz")
    return p.parse_args(argv)


def model_config(args):
    if args.tiny or args.shape == "1b":
        return common.model_config(args.tiny)
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False)


def run_config(args, section_path: str, section):
    from rlcore.config.schema import OptimizerConfig, PolicyConfig, RunConfig, SequencePackingConfig

    policy = PolicyConfig(
        model_name="<random-init>", precision="float32" if args.tiny and not args.bf16 else "bfloat16", max_grad_norm=1.0,
        optimizer=OptimizerConfig(lr=1e-5, weight_decay=0.01),
        sequence_packing=SequencePackingConfig(train_mb_tokens=args.mb_tokens, logprob_mb_tokens=args.mb_tokens))
    return RunConfig(policy=policy, sections={section_path: section})


def build_megatron(args, hf_config, device):
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.config import SECTION, MegatronConfig, MegatronOptimizerConfig

    cfg = MegatronConfig(enabled=True, tensor_model_parallel_size=args.tp, activation_checkpointing=args.ac,
                         sequence_parallel=args.sp,
                         optimizer=MegatronOptimizerConfig(lr=1e-5, weight_decay=0.01, clip_grad=1.0))
    world = WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(), device=device)
    return MegatronBackend(run_config(args, SECTION, cfg), cfg, world, hf_config=hf_config, seed=args.seed)


def build_fsdp2(args, hf_config, device):
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig

    cfg = DTensorConfig(activation_checkpointing=args.ac, empty_cache_after_train=False)
    world = WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(), device=device)
    return FSDP2Backend(run_config(args, SECTION, cfg), cfg, world, hf_config=hf_config, seed=args.seed)


def make_batch(args, vocab: int, gen: torch.Generator, dp: int):
    scaled = argparse.Namespace(**{**vars(args), "micro_batches": args.micro_batches * dp})
    return common.make_batch(scaled, vocab, gen)


def run_variant(args, name: str, hf_config, device: str) -> dict:
    from rlcore.algorithms.sft import SFT

    t0 = time.perf_counter()
    backend = (build_megatron if name == "megatron" else build_fsdp2)(args, hf_config, device)
    build_s = time.perf_counter() - t0
    dp = dist.get_world_size() // (args.tp if name == "megatron" else 1)
    algo, gen = SFT(), torch.Generator().manual_seed(args.seed)  # same batches for every variant
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, tokens, flops, mbs = [], [], [], []
    for step in range(args.warmup + args.steps):
        batch = make_batch(args, hf_config.vocab_size, gen, dp)
        common.sync(device)
        dist.barrier()
        start = time.perf_counter()
        metrics = backend.train(batch, algo)
        common.sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            tokens.append(sum(batch.lengths()))
            flops.append(common.step_flops(hf_config, batch.lengths()))
            mbs.append(metrics["num_micro_batches"])
        if not all(v == v for v in metrics.values()):
            raise RuntimeError(f"{name}: non-finite metrics at step {step}: {metrics}")
    if args.profile and dist.get_rank() == 0:
        common.profile_steps(lambda: backend.train(make_batch(args, hf_config.vocab_size, gen, dp), algo), 2,
                             args.profile, name, device)
    elif args.profile:  # the other ranks take the same steps, unprofiled
        for _ in range(2):
            backend.train(make_batch(args, hf_config.vocab_size, gen, dp), algo)
    gpus = dist.get_world_size()
    med = statistics.median(times)
    result = {
        "variant": (f"megatron (TP={args.tp}{' SP' if args.sp else ''}, DP={gpus // args.tp})" if name == "megatron"
                    else f"fsdp2 (FSDP={gpus})"),
        "build_s": build_s, "step_s": med, "tokens_per_step": statistics.median(tokens),
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
        "tflops": statistics.median(f / s for f, s in zip(flops, times)) / 1e12,
        "micro_batches": statistics.median(mbs),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan"),
        "last_loss": metrics["loss"],
    }
    result["mfu"] = result["tflops"] / (args.peak_tflops * gpus)
    backend.shutdown()
    del backend
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def worker(rank: int, world: int, port: int, args) -> int:
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = True
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, **({"device_id": torch.device("cuda", rank)} if device == "cuda" else {}))
    hf_config = model_config(args)
    if rank == 0:
        print(f"device={device} gpus={world} torch={torch.__version__} shape={'tiny' if args.tiny else args.shape} "
              f"N_matmul={common.matmul_params(hf_config) / 1e9:.3f}e9 micro-batches/step/DP rank={args.micro_batches} "
              f"x {args.mb_tokens} tokens, lengths [{args.min_len}, {args.max_len}]", flush=True)
    rows, variants = [], ["megatron"] + (["fsdp2"] if args.with_fsdp2 else [])
    for name in variants:
        try:
            rows.append(run_variant(args, name, hf_config, device))
        except Exception:  # noqa: BLE001 - report and go on with the other variant
            print(f"[rank {rank}] variant {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    if rank == 0:
        print("| variant | step (s) | tokens/step | micro-batches/rank | tokens/s | TFLOP/s | MFU | peak mem/GPU (GiB) | build (s) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['variant']} | {r['step_s']:.3f} | {r['tokens_per_step']:.0f} | {r['micro_batches']:.0f} | "
                  f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.1f} | {r['build_s']:.1f} |",
                  flush=True)
    dist.destroy_process_group()
    return 0 if len(rows) == len(variants) else 1


def _spawned(rank: int, world: int, port: int, args) -> None:
    if worker(rank, world, port, args):
        raise SystemExit(1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: use --tiny for the CPU smoke run", file=sys.stderr)
        return 2
    if args.tiny:
        args.mb_tokens, args.min_len, args.max_len = min(args.mb_tokens, 256), min(args.min_len, 16), min(args.max_len, 128)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("nccl" if not args.tiny else "gloo")
        return worker(dist.get_rank(), dist.get_world_size(), 0, args)
    port = free_port()
    gpus = args.gpus or args.tp
    if gpus % args.tp:
        print(f"--gpus {gpus} is not a multiple of --tp {args.tp}", file=sys.stderr)
        return 2
    if gpus == 1:
        return worker(0, 1, port, args)
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(gpus, port, args), nprocs=gpus, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
