"""Generation throughput of the rlcore vLLM generator (sync engine), eager and with CUDA graphs.

Default: the 1.2B Llama shape (hidden 2048, 16 layers, GQA 32/8, vocab 128256, intermediate
8192), random weights (vLLM's dummy loader, bf16), 512 prompts of 128 random tokens x 512 new
tokens with ``ignore_eos``. Each mode runs in its own process (a fresh engine); one warm-up
batch, then ``--repeats`` timed batches, median reported. Prints one JSON line per mode and variant.

    python benchmarks/bench_generation.py                     # GPU, both modes
    python benchmarks/bench_generation.py --tiny              # CPU check: tiny model, eager only
    # the GRPO step's generation (32 prompts x 8 samples x 1024 tokens), both text paths, profiled:
    python benchmarks/bench_generation.py --mode graphs --num-prompts 32 --samples-per-prompt 8 \
        --prompt-len 48 --new-tokens 1024 --variants engine-detok,batched-detok --profile /tmp/prof

``--variants`` compare per-request settings on one engine: ``engine-detok`` (vLLM decodes the
text token by token in its output loop, its default) and ``batched-detok`` (rlcore's default:
one batched decode per response); ``batched-detok-unseeded`` also leaves out the per-request seed
(``experimental.request_seeds: false``: vLLM draws seeded requests' noise one request at a time). ``--engine-process`` runs vLLM's engine core in its own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``), overlapping output handling with the next step.
``--quantization none,fp8,fp8-kv`` compares the bf16 engine with vLLM's online FP8 (per-tensor W8A8,
the weights quantized as they load) and with an FP8 KV cache besides, each in its own process;
``fp8-kv-torchmm`` is ``fp8-kv`` with vLLM's CUTLASS FP8 GEMM turned off (``VLLM_DISABLED_KERNELS``), so
that ``torch._scaled_mm`` (cuBLASLt) runs the GEMMs. Rows go to ``benchmarks/results.jsonl``.
``--engines-per-gpu N`` splits the prompts over N engines sharing the device, each in a process of its own
(its own host thread for vLLM's scheduler and output handling, which bound a decode step at 256 sequences on the
H200 hosts), timed together: each batch starts at a barrier, and a row's tokens/s is all engines' tokens over the
span from the first start to the last end. ``--gpu-kv-cache-gib`` sizes each engine's KV cache (needed when
several share the device: vLLM's memory profiling fails while another process allocates).
``--profile DIR``: one more batch of the first variant under cProfile (host time by function,
top rows printed, ``.pstats`` written), and a short batch under torch.profiler (Chrome trace
for ``trace_summary.py``: how busy the GPU is between decode steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_log  # noqa: E402

# name -> policy.generation.experimental overrides applied per request on one engine
VARIANTS = {"engine-detok": {"engine_detokenize": True}, "batched-detok": {"engine_detokenize": False},
            "batched-detok-unseeded": {"engine_detokenize": False, "request_seeds": False}}


def with_experimental(config, overrides: dict):
    """``config`` with ``overrides`` applied to its ``experimental`` section."""
    return attrs.evolve(config, experimental=attrs.evolve(config.experimental, **overrides))


# --quantization name -> (VllmConfig.quantization, VllmConfig.kv_cache_dtype, vLLM kernels turned off)
# fp8-kv-torchmm: vLLM's CUTLASS FP8 GEMM off, so its next choice runs them: torch._scaled_mm (cuBLASLt), with
# the per-token scales applied after it (bench_fp8_gemm.py times both kernels alone: at 256 sequences of the 8B
# shape CUTLASS is 1.47x bf16, the fp32-output path 0.92x).
QUANTIZATIONS = {"none": ("none", "auto", ""), "fp8": ("fp8", "auto", ""), "fp8-kv": ("fp8", "fp8", ""),
                 "kv8": ("none", "fp8", ""), "fp8-kv-torchmm": ("fp8", "fp8", "CutlassFP8ScaledMMLinearKernel")}


def run_mode(args) -> list[dict]:
    import os

    import attrs
    import torch

    from rlcore_vllm.benchmarking import config_only_model, gpu_env_defaults, has_cuda

    quantization, kv_cache_dtype, disabled_kernels = QUANTIZATIONS[args.quantization]
    if disabled_kernels:  # read by vLLM when it picks a kernel; this process (and its engine) runs one quantization
        os.environ["VLLM_DISABLED_KERNELS"] = disabled_kernels
    cuda = has_cuda()
    if args.engine_process:  # spawn: has_cuda() below initialises CUDA, which a forked engine cannot reuse
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if cuda:
        gpu_env_defaults()
    from rlcore.interfaces import SamplingParams
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import VllmGenerator

    dtype = "bfloat16" if cuda else "float32"
    model_dir = config_only_model(Path(args.workdir) / args.shape, args.shape, dtype)
    cfg = VllmConfig(enforce_eager=args.mode == "eager", gpu_memory_utilization=args.gpu_memory_utilization,
                     max_num_seqs=args.max_num_seqs, kv_cache_space_gib=args.kv_cache_space_gib, enable_prefix_caching=False,
                     quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                     gpu_kv_cache_gib=args.gpu_kv_cache_gib if cuda else None)
    start = time.perf_counter()
    gen = VllmGenerator(str(model_dir), cfg, max_model_len=args.prompt_len + args.new_tokens + 8, dtype=dtype, seed=0,
                        device="cuda" if cuda else "cpu", engine_kwargs={"load_format": "dummy"})
    startup_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(0)
    vocab = gen.tokenizer.vocab_size if hasattr(gen.tokenizer, "vocab_size") else 100
    prompts = torch.randint(10, min(vocab, 30000), (args.num_prompts, args.prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0, n=args.samples_per_prompt)
    gen.generate(prompts[: max(1, args.num_prompts // 8)], SamplingParams(max_new_tokens=16, ignore_eos=True))  # warm-up
    base_config, rows = gen.config, []
    for variant in args.variants.split(","):
        gen.config = with_experimental(base_config, VARIANTS[variant])
        times, windows, tokens = [], [], 0
        for repeat in range(args.repeats):
            if cuda:
                torch.cuda.synchronize()
            if args.barrier:
                _barrier(Path(args.barrier), f"{variant}-{repeat}", args.engine_index, args.barrier_count)
            t0, wall0 = time.perf_counter(), time.time()
            results = gen.generate(prompts, params)
            times.append(time.perf_counter() - t0)
            windows.append((wall0, time.time()))
            tokens = sum(len(r.response_ids) for per_prompt in results for r in per_prompt)
        if args.barrier:  # one engine of several: the parent adds up the engines' rows
            print("ENGINE " + json.dumps({"variant": variant, "windows": windows, "tokens": tokens, "engine_start_s": startup_s}),
                  flush=True)
            continue
        seconds = statistics.median(times)
        # under MPS, the engine's context capped at this share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
        sm_cap = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else None
        rows.append({"bench": "generation", "shape": args.shape, "mode": args.mode, "quantization": args.quantization,
                     "variant": (variant if args.quantization == "none" else f"{variant}-{args.quantization}")
                     + (f"-mps{sm_cap}pct" if sm_cap else ""), "mps_sm_cap_percent": int(sm_cap) if sm_cap else None,
                     "engine_process": args.engine_process, "device": "cuda" if cuda else "cpu",
                     "num_prompts": args.num_prompts, "samples_per_prompt": args.samples_per_prompt,
                     "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "generated_tokens": tokens,
                     "seconds_median": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                     "decode_step_ms": round(1000 * seconds / args.new_tokens, 2),
                     "engine_start_s": round(startup_s, 1), "repeats": args.repeats})
        print(json.dumps(rows[-1]), flush=True)
    if args.profile:
        gen.config = with_experimental(base_config, VARIANTS[args.variants.split(",")[0]])
        placement = "mp" if args.engine_process else "inproc"
        profile(gen, prompts, params, Path(args.profile), f"gen-{args.mode}-{args.quantization}-{placement}", cuda)
    gen.shutdown()
    if not args.barrier:
        results_log.append(rows, bench="bench_generation", config=f"{args.shape}-{args.mode}", gpus=1 if cuda else 0)
    return rows


def _barrier(directory: Path, name: str, index: int, count: int, timeout_s: float = 900.0) -> None:
    """Wait until all ``count`` engines reached barrier ``name`` (one file each in ``directory``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.{index}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(directory.glob(f"{name}.*"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: {len(list(directory.glob(f'{name}.*')))} of {count} engines "
                               f"arrived in {timeout_s:.0f} s (one of them failed or is still starting; see its output)")
        time.sleep(0.002)


def run_engines(args, argv: list[str]) -> list[dict]:
    """``--engines-per-gpu N``: N processes of this script, each an engine with its share of the prompts, timed
    together; one row per variant with all engines' tokens over the span of each batch (median over repeats)."""
    import os
    import shutil

    n = args.engines_per_gpu
    if _cuda_visible() and args.gpu_kv_cache_gib is None:
        raise SystemExit("--engines-per-gpu on a GPU needs --gpu-kv-cache-gib (and --gpu-memory-utilization under 1/N): "
                         "vLLM sizes the cache from the free memory, which the other engines are still taking")
    if args.num_prompts % n:
        raise SystemExit(f"--num-prompts {args.num_prompts} must be a multiple of --engines-per-gpu {n}")
    from rlcore_vllm.benchmarking import config_only_model

    cuda = _cuda_visible()
    config_only_model(Path(args.workdir) / args.shape, args.shape, "bfloat16" if cuda else "float32")  # once, for all engines
    barrier = Path(tempfile.mkdtemp(prefix="rlcore-bench-gen-barrier-"))
    base = results_log.argv_without(argv, ("--engines-per-gpu", "--num-prompts", "--workdir"))
    procs = [subprocess.Popen([sys.executable, __file__, *base, "--num-prompts", str(args.num_prompts // n),
                               "--workdir", args.workdir, "--barrier", str(barrier), "--engine-index", str(i),
                               "--barrier-count", str(n)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RLCORE_RUN_ID": results_log.RUN_ID})
             for i in range(n)]
    reports: list[list[dict]] = [[] for _ in procs]

    def relay(i: int) -> None:  # one thread an engine: a full pipe would stop it at the next barrier
        for line in procs[i].stdout:
            print(f"[engine {i}] {line}", end="", flush=True)
            if line.startswith("ENGINE "):
                reports[i].append(json.loads(line[len("ENGINE "):]))

    relays = [threading.Thread(target=relay, args=(i,), daemon=True) for i in range(n)]
    for thread in relays:
        thread.start()
    while any(proc.poll() is None for proc in procs):
        if failed := [i for i, proc in enumerate(procs) if proc.poll() not in (None, 0)]:
            for proc in procs:
                proc.kill()
            raise SystemExit(f"engine {failed[0]} of {n} exited with status {procs[failed[0]].returncode}")
        time.sleep(1.0)
    for thread in relays:
        thread.join()
    shutil.rmtree(barrier, ignore_errors=True)
    if failed := [i for i, proc in enumerate(procs) if proc.returncode != 0]:
        raise SystemExit(f"engine {failed[0]} of {n} exited with status {procs[failed[0]].returncode}")
    rows = []
    for per_variant in zip(*reports):
        variant = per_variant[0]["variant"]
        spans = [max(r["windows"][k][1] for r in per_variant) - min(r["windows"][k][0] for r in per_variant)
                 for k in range(len(per_variant[0]["windows"]))]
        tokens, seconds = sum(r["tokens"] for r in per_variant), statistics.median(spans)
        rows.append({"bench": "generation", "shape": args.shape, "mode": args.mode, "quantization": args.quantization,
                     "variant": (variant if args.quantization == "none" else f"{variant}-{args.quantization}") + f"-{n}engines",
                     "engines_per_gpu": n, "engine_process": args.engine_process, "device": "cuda" if cuda else "cpu",
                     "num_prompts": args.num_prompts, "samples_per_prompt": args.samples_per_prompt,
                     "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "generated_tokens": tokens,
                     "seconds_median": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                     "decode_step_ms": round(1000 * seconds / args.new_tokens, 2),
                     "engine_start_s": round(max(r["engine_start_s"] for r in per_variant), 1),
                     "gpu_kv_cache_gib": args.gpu_kv_cache_gib, "repeats": args.repeats})
        print(json.dumps(rows[-1]), flush=True)
    results_log.append(rows, bench="bench_generation", config=f"{args.shape}-{args.mode}",
                       gpus=1 if cuda else 0)
    return rows


def _cuda_visible() -> bool:
    """Whether the engines ran on a GPU, without initialising CUDA in this (parent) process."""
    import shutil

    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def profile(gen, prompts, params, out: Path, name: str, cuda: bool) -> None:
    """cProfile over one full batch (host time), torch.profiler over a 64-token batch (GPU busy share)."""
    import cProfile
    import pstats

    import attrs

    import torch

    out.mkdir(parents=True, exist_ok=True)
    profiler = cProfile.Profile()
    profiler.enable()
    gen.generate(prompts, params)
    profiler.disable()
    profiler.dump_stats(out / f"{name}.pstats")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    short = attrs.evolve(params, max_new_tokens=64)
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        gen.generate(prompts, short)
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / f"{name}.json"))
    print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=15), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU check: tiny model, 32 prompts x 32 tokens, eager")
    parser.add_argument("--shape", default=None, choices=["1.2b", "8b", "tiny"])
    parser.add_argument("--mode", default=None, choices=["eager", "graphs", "both"])
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="n: samples of each prompt (GRPO: 8)")
    parser.add_argument("--variants", default="batched-detok", help=f"comma list of {sorted(VARIANTS)}")
    parser.add_argument("--engine-process", action="store_true", help="vLLM engine core in its own process")
    parser.add_argument("--profile", default=None, help="directory for cProfile stats and a torch.profiler trace")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--kv-cache-space-gib", type=float, default=0.5)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--engines-per-gpu", type=int, default=1, help="engines sharing the device, each in its own process")
    parser.add_argument("--gpu-kv-cache-gib", type=float, default=None, help="KV cache of each engine on GPU (GiB)")
    parser.add_argument("--barrier", default=None, help=argparse.SUPPRESS)  # set by --engines-per-gpu for its engines
    parser.add_argument("--engine-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--barrier-count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="none",
                        help=f"comma list of {', '.join(QUANTIZATIONS)} (fp8: weights and activations; kv8 / fp8-kv: "
                             "FP8 KV cache without / with them); a fresh engine process each")
    args = parser.parse_args()
    tiny = args.tiny
    args.shape = args.shape or ("tiny" if tiny else "1.2b")
    args.mode = args.mode or ("eager" if tiny else "both")
    args.num_prompts = args.num_prompts or (32 if tiny else 512)
    args.prompt_len = args.prompt_len or (32 if tiny else 128)
    args.new_tokens = args.new_tokens or (32 if tiny else 512)
    if tiny:
        args.repeats = min(args.repeats, 2)
    quantizations = args.quantization.split(",")
    if unknown := set(quantizations) - set(QUANTIZATIONS):
        parser.error(f"--quantization: unknown {sorted(unknown)}; choose from {sorted(QUANTIZATIONS)}")
    if args.mode != "both" and len(quantizations) == 1:
        args.workdir = args.workdir or tempfile.mkdtemp(prefix="rlcore-bench-gen-")
        unknown = set(args.variants.split(",")) - set(VARIANTS)
        if unknown:
            parser.error(f"--variants: unknown {sorted(unknown)}; choose from {sorted(VARIANTS)}")
        if args.engines_per_gpu > 1:
            run_engines(args, sys.argv[1:])
        else:
            run_mode(args)
        return
    runs = [["--mode", mode, "--quantization", q] for mode in (("eager", "graphs") if args.mode == "both" else (args.mode,))
            for q in quantizations]  # a fresh process (and engine) each
    if results_log.run_each(__file__, sys.argv[1:], ("--mode", "--quantization"), runs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
