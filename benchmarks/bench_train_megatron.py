"""Training throughput and MFU of the megatron backend's variants (and fsdp2) on the same packed batches.

    python benchmarks/bench_train_megatron.py --steps 10                    # one H200: 1.2B Llama shape, bf16
    python benchmarks/bench_train_megatron.py --with-fsdp2                  # + the fsdp2 backend compiled, same batches
    python benchmarks/bench_train_megatron.py --variants megatron,megatron-fp8,megatron-plain,fsdp2-compile --micro-batches 16
    python benchmarks/bench_train_megatron.py --shape 8b --tp 2 --with-fsdp2 --steps 5   # 2 GPUs
    python benchmarks/bench_train_megatron.py --shape 8b --gpus 2 --with-fsdp2           # Megatron DP=2, as fsdp2
    python benchmarks/bench_train_megatron.py --tiny --steps 3              # CPU smoke run (tiny shape, fp32)
    python benchmarks/bench_train_megatron.py --variants megatron,fsdp2 --mb-tokens 8192 --memory-report  # tensors at the peak
    python benchmarks/bench_train_megatron.py --shape qwen3moe --variants megatron,megatron-moe-loop,fsdp2 --mb-tokens 8192
    python benchmarks/bench_train_megatron.py --shape qwen3moe --variants megatron,megatron-moe-te-grouped,fsdp2 --mb-tokens 8192
    python benchmarks/bench_train_megatron.py --shape qwen3moe --tiny --variants megatron,fsdp2 --steps 2  # CPU smoke

Models (random init from the config, built by the backend itself: ``MegatronBackend(...,
hf_config=...)``): ``1b`` = Llama-3.2-1B shape (hidden 2048, 16 layers, GQA 32/8, head_dim 64,
intermediate 8192, vocab 128256, tied embeddings); ``8b`` = Llama-3.1-8B shape (hidden 4096, 32
layers, GQA 32/8, intermediate 14336, vocab 128256, untied); ``qwen3moe`` = Qwen3-30B-A3B's layer
(128 experts of FFN 768, top-8, GQA 32/4, head_dim 128, vocab 151936) at 8 layers (``--layers``):
5.61B parameters, 0.77B active matmul parameters a token (``moe_shapes.py`` says why 8 fits one
H200); its MFU counts active parameters. bf16 parameters, fp32 main weights
and gradient reduction in Megatron's distributed optimizer, AdamW. Each optimizer step trains
``--micro-batches`` packed micro-batches of at most ``--mb-tokens`` tokens per data-parallel rank
(random lengths in [``--min-len``, ``--max-len``], rlcore's packer) with the registered ``sft``
loss. ``--gpus N`` (default ``--tp``) spawns N processes, one per GPU, unless launched by
torchrun; Megatron runs TP=``--tp`` and DP=N/tp, fsdp2 data-parallel over the same GPUs on the
same global batches. ``--profile DIR`` profiles two more steps (see ``trace_summary.py``).

Variants (``--variants``, comma-separated; each a ``policy.megatron_cfg`` override of the
defaults): ``megatron`` (the defaults: Transformer Engine's layers when TE loads, flash
attention, fused RoPE/SwiGLU/weight-gradient accumulation, MLPs through TE's op fuser),
``megatron-no-opfuse``, ``megatron-moe-loop`` (MoE experts as a loop of TE linears, unfused permute:
the path before grouped GEMM), ``megatron-moe-grouped-mm`` (each expert projection one torch
``grouped_mm`` call, ``rlcore_megatron.moe_grouped_mm``: what ``megatron`` picks in bf16 on CUDA),
``megatron-moe-te-grouped`` (TE's grouped linear with device split sizes: ``megatron`` before
``grouped_mm``), ``megatron-moe-host-splits`` (Megatron's own grouped experts:
split sizes on the host, one expert GEMM launched at a time), ``megatron-local`` (Megatron's local
spec), ``megatron-te-attn`` (TE's cuDNN attention), ``megatron-unfused-wgrad``, ``megatron-fp8``
(tensorwise), ``megatron-fp8-delayed``, ``megatron-fp8-blockwise``, ``megatron-fp8-delayed-no-opfuse``,
``megatron-cuda-graph`` (each training micro-batch padded to ``--mb-tokens`` and replayed as a CUDA
graph, ``policy.megatron_cfg.cuda_graph: micro_batch``; on CPU it runs without capture),
``megatron-cuda-graph-eager`` (the same padded static buffers without capture: the padding's cost
alone), ``megatron-plain`` (a plain
Megatron-Core loop over the same model, optimizer and packed micro-batches, with none of the
backend's wrapper: what the wrapper costs), ``fsdp2`` and ``fsdp2-compile``.

MFU against ``--peak-tflops`` (989 = H200 dense bf16 datasheet; FP8 rows too, so they read as
bf16-equivalent), the same formula as bench_train_fsdp2.py::

    FLOPs/step = 6 * N_matmul * T  +  6 * L * d_attn * sum_i len_i^2     (T = real tokens)
    MFU        = FLOPs/step / step time / (peak x number of GPUs)

Every row is appended to ``benchmarks/results.jsonl`` (``results_log.py``).
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
from rlcore.controller.allocator import use_expandable_segments

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_fsdp2 as common  # noqa: E402  (model shapes, FLOP formula, batch maker)
import memory_peak  # noqa: E402
import moe_shapes  # noqa: E402
import results_log  # noqa: E402
from rlcore.utils import free_port  # noqa: E402

MEGATRON_VARIANTS = {
    "megatron": {},
    "megatron-local": {"transformer_impl": "local"},
    "megatron-te-attn": {"core_attention": "transformer_engine"},
    "megatron-unfused-wgrad": {"gradient_accumulation_fusion": False},
    "megatron-fp8": {"fp8_cfg": {"enabled": True, "fp8_recipe": "tensorwise"}},
    "megatron-fp8-delayed": {"fp8_cfg": {"enabled": True, "fp8_recipe": "delayed"}},
    "megatron-fp8-blockwise": {"fp8_cfg": {"enabled": True, "fp8_recipe": "blockwise"}},
    "megatron-no-opfuse": {"use_te_op_fuser": False},
    "megatron-fp8-delayed-no-opfuse": {"fp8_cfg": {"enabled": True, "fp8_recipe": "delayed"}, "use_te_op_fuser": False},
    "megatron-plain": {},
    "megatron-moe-loop": {"moe_grouped_gemm": False, "moe_permute_fusion": False},
    # Megatron's TEGroupedMLP: host split sizes
    "megatron-moe-host-splits": {"moe_experts_impl": "te_grouped", "moe_device_splits": False},
    "megatron-moe-grouped-mm": {"moe_experts_impl": "grouped_mm"},  # torch grouped GEMM experts (auto's choice in bf16 on CUDA)
    "megatron-moe-te-grouped": {"moe_experts_impl": "te_grouped"},  # TE's grouped linear, device split sizes
    # each micro-batch a CUDA-graph replay (rlcore_megatron.cuda_graph); -eager: the same padded static buffers, no capture
    "megatron-cuda-graph": {"cuda_graph": "micro_batch"},
    "megatron-cuda-graph-eager": {"cuda_graph": "micro_batch"},
}
NO_CAPTURE_VARIANTS = {"megatron-cuda-graph-eager"}  # on CPU every cuda-graph variant runs without capture
FSDP2_VARIANTS = {"fsdp2": False, "fsdp2-compile": True, "fsdp2-prealloc": False, "fsdp2-reshard": False}  # name -> torch.compile
# policy.dtensor_cfg keys of a variant: fsdp2-reshard groups the parameters per layer with one rank too and frees a
# layer's gathered weights after its forward (the reduce-scatter buffer is then a layer's, not the whole model's)
FSDP2_SETTINGS = {"fsdp2-reshard": {"reshard_after_forward": True}}
# experimental settings of a variant (rlcore_fsdp2.config.DTensorExperimentalConfig)
FSDP2_EXPERIMENTAL = {"fsdp2-prealloc": {"preallocate_grad_accumulators": True}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    p.add_argument("--micro-batches", type=int, default=4, help="packed micro-batches per optimizer step per DP rank")
    p.add_argument("--mb-tokens", type=int, default=4096, help="token budget of a micro-batch")
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--shape", choices=("1b", "8b", "qwen3moe"), default="1b")
    p.add_argument("--layers", type=int, default=moe_shapes.DEFAULT_LAYERS, help="depth of the qwen3moe shape")
    p.add_argument("--ep", type=int, default=1, help="Megatron expert-parallel size (MoE shapes)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--gpus", type=int, default=None, help="processes/GPUs (default: --tp); Megatron's DP = gpus / tp")
    p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism (with --tp > 1)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing (full recompute)")
    p.add_argument("--variants", default="megatron", help=f"comma-separated, from {', '.join([*MEGATRON_VARIANTS, *FSDP2_VARIANTS])}")
    p.add_argument("--with-fsdp2", action="store_true", help="add fsdp2-compile to the variants")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--tiny", action="store_true", help="tiny shape on CPU in fp32 (smoke test)")
    p.add_argument("--bf16", action="store_true", help="with --tiny: bf16 as on GPU (checks that code path on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="each variant in a fresh process (default: on GPU for qwen3moe, where one variant's "
                        "memory is not all returned before the next one builds, and with CUDA-graph variants)")
    p.add_argument("--profile", metavar="DIR", help="profile 2 more steps (rank 0): print tables, write DIR/<variant>.json.gz")
    p.add_argument("--memory-report", action="store_true",
                   help="one more step with the allocator's history recorded (rank 0): the tensors alive at its peak, by site")
    p.add_argument("--profile-stack", action="store_true", help="record Python stacks too (host frames in trace_summary.py)")
    return p.parse_args(argv)


def model_config(args):
    if args.shape == "qwen3moe":
        return moe_shapes.qwen3moe_config(args.layers, tiny=args.tiny)
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


def megatron_section(args, overrides: dict):
    from rlcore.config import structure
    from rlcore_megatron.config import SECTION, MegatronConfig

    data = {"enabled": True, "tensor_model_parallel_size": args.tp, "activation_checkpointing": args.ac,
            "sequence_parallel": args.sp, **({"expert_model_parallel_size": args.ep} if args.ep > 1 else {}), "optimizer": {"lr": 1e-5, "weight_decay": 0.01, "clip_grad": 1.0}, **overrides}
    return structure(MegatronConfig, data, SECTION)


def world_info(device):
    from rlcore.interfaces import WorldInfo

    return WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(), device=device)


def build_megatron(args, hf_config, device, name: str):
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.config import SECTION

    cfg = megatron_section(args, MEGATRON_VARIANTS[name])
    return MegatronBackend(run_config(args, SECTION, cfg), cfg, world_info(device), hf_config=hf_config, seed=args.seed,
                           cuda_graph_capture=device == "cuda" and name not in NO_CAPTURE_VARIANTS)


def build_fsdp2(args, hf_config, device, name: str):
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig, DTensorExperimentalConfig

    cfg = DTensorConfig(activation_checkpointing=args.ac, compile=FSDP2_VARIANTS[name], **FSDP2_SETTINGS.get(name, {}),
                        experimental=DTensorExperimentalConfig(empty_cache_after_train=False,
                                                               **FSDP2_EXPERIMENTAL.get(name, {})))
    return FSDP2Backend(run_config(args, SECTION, cfg), cfg, world_info(device), hf_config=hf_config, seed=args.seed)


class PlainMegatronLoop:
    """Megatron-Core driven directly: the backend's model builder, DDP and optimizer, rlcore's
    packer and logprob kernel, and nothing else (no algorithm, no metric reduction, no checks)."""

    def __init__(self, args, hf_config, device):
        from rlcore_megatron import cpu_shims, kernels, parallel
        from rlcore_megatron.config import SECTION

        self.args, self.cfg, self.device = args, megatron_section(args, {}), device
        run = run_config(args, SECTION, self.cfg)
        if device != "cuda":
            cpu_shims.install()
        with cpu_shims.active():
            parallel.initialize(self.cfg, hf_config, run, args.seed)
            self.kernels = kernels.resolve(self.cfg, on_cuda=device == "cuda",
                                           bf16=parallel.params_dtype(self.cfg, run) == torch.bfloat16)
            model = parallel.build_model(self.cfg, hf_config, run, self.kernels, on_cpu=device != "cuda")
            self.model = parallel.wrap_ddp(model, self.cfg)
            self.optimizer = parallel.build_optimizer(self.model, self.cfg, run)

    def train(self, batch, algorithm) -> dict:
        from rlcore_megatron import cpu_shims

        with cpu_shims.active():
            return self._train(batch)

    def _train(self, batch) -> dict:
        from megatron.core import parallel_state as mpu
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from rlcore.training.ops import token_logprobs
        from rlcore.data.packing import make_micro_batches
        from rlcore_megatron.model import packed_seq_params

        mbs = make_micro_batches(batch, self.args.mb_tokens, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                                 pad_to_multiple=self.args.tp * self.kernels.token_multiple, pack=True)
        total = sum(float(mb.loss_mask_T.sum()) for mb in mbs)
        inputs = [(mb.input_ids_T.to(self.device, non_blocking=True), mb.loss_mask_T.to(self.device, non_blocking=True),
                   mb.position_ids_T.to(self.device, non_blocking=True), mb.cu_seqlens,
                   packed_seq_params(mb.cu_seqlens, mb.num_tokens, int(mb.max_seqlen), self.device)) for mb in mbs]

        def forward_step(data, model):
            ids, mask, pos, cu, params = next(data)
            out = model(ids[None], pos[None], None, packed_seq_params=params)

            def loss(output):
                value = -(token_logprobs(output.squeeze(0), ids, cu) * mask).sum() / total
                return value, torch.tensor(1, dtype=torch.int), {"loss": value.detach()}
            return out, loss

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(inputs), model=[self.model],
                                              num_microbatches=len(mbs), seq_length=max(mb.num_tokens for mb in mbs),
                                              micro_batch_size=1, forward_only=False)
        self.optimizer.step()
        return {"loss": float(sum(o["loss"] for o in outputs)), "num_micro_batches": float(len(mbs))}

    def shutdown(self) -> None:
        self.model = self.optimizer = None


def build(args, hf_config, device, name: str):
    if name == "megatron-plain":
        return PlainMegatronLoop(args, hf_config, device)
    return (build_megatron if name in MEGATRON_VARIANTS else build_fsdp2)(args, hf_config, device, name)


def make_batch(args, vocab: int, gen: torch.Generator, dp: int):
    scaled = argparse.Namespace(**{**vars(args), "micro_batches": args.micro_batches * dp})
    return common.make_batch(scaled, vocab, gen)


def shape_label(args) -> str:
    if args.shape == "qwen3moe":
        return f"{'tiny-' if args.tiny else ''}qwen3moe x{args.layers if not args.tiny else 2} layers"
    return "tiny" if args.tiny else args.shape


def step_flops(hf_config, lengths: list[int]) -> float:
    """Training FLOPs of a step: dense shapes count every parameter, MoE shapes the active ones."""
    if getattr(hf_config, "num_experts", None):
        return moe_shapes.step_flops(hf_config, lengths)
    return common.step_flops(hf_config, lengths)


def matmul_params(hf_config) -> int:
    return moe_shapes.params(hf_config)[1] if getattr(hf_config, "num_experts", None) else common.matmul_params(hf_config)


def run_variant(args, name: str, hf_config, device: str) -> dict:
    from rlcore.algorithms.sft import SFT

    t0 = time.perf_counter()
    backend = build(args, hf_config, device, name)
    build_s = time.perf_counter() - t0
    dp = dist.get_world_size() // (args.tp if name in MEGATRON_VARIANTS else 1)
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
            flops.append(step_flops(hf_config, batch.lengths()))
            mbs.append(metrics["num_micro_batches"])
        if not all(v == v for v in metrics.values()):
            raise RuntimeError(f"{name}: non-finite metrics at step {step}: {metrics}")
    if args.profile and dist.get_rank() == 0:
        common.profile_steps(lambda: backend.train(make_batch(args, hf_config.vocab_size, gen, dp), algo), 2,
                             args.profile, name, device, with_stack=args.profile_stack)
    elif args.profile:  # the other ranks take the same steps, unprofiled
        for _ in range(2):
            backend.train(make_batch(args, hf_config.vocab_size, gen, dp), algo)
    if args.memory_report and device == "cuda":
        step = lambda: backend.train(make_batch(args, hf_config.vocab_size, gen, dp), algo)  # noqa: E731
        if dist.get_rank() == 0:
            print(f"[memory {name}]\n" + memory_peak.record(step))
        else:
            step()
    gpus = dist.get_world_size()
    med = statistics.median(times)
    layout = (f"TP={args.tp}{' SP' if args.sp else ''}, DP={gpus // args.tp}" if name in MEGATRON_VARIANTS else f"FSDP={gpus}")
    result = {
        "variant": name, "layout": layout, "kernels": getattr(getattr(backend, "kernels", None), "describe", lambda: "")(),
        "build_s": build_s, "step_s": med, "tokens_per_step": statistics.median(tokens),
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
        "tflops": statistics.median(f / s for f, s in zip(flops, times)) / 1e12,
        "micro_batches": statistics.median(mbs),
        **common.memory_fields(device),
        "last_loss": metrics["loss"],
    }
    graphs = getattr(backend, "graphs", None)
    if graphs is not None:  # buckets captured (or, without capture, filled) over the run, incl. warm-up steps
        result["cuda_graph_buckets"] = len(graphs.static)
        result["cuda_graphs_captured"] = len(graphs.graphs)
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
        print(f"device={device} gpus={world} torch={torch.__version__} shape={shape_label(args)} "
              f"N_matmul={matmul_params(hf_config) / 1e9:.3f}e9 (active) micro-batches/step/DP rank={args.micro_batches} "
              f"x {args.mb_tokens} tokens, lengths [{args.min_len}, {args.max_len}], host {common.host_speed_us():.2f} us "
              "per small eager op", flush=True)
    variants = args.variants.split(",") + (["fsdp2-compile"] if args.with_fsdp2 and "fsdp2-compile" not in args.variants else [])
    unknown = [v for v in variants if v not in MEGATRON_VARIANTS and v not in FSDP2_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join([*MEGATRON_VARIANTS, *FSDP2_VARIANTS])}")
    rows = []
    for name in variants:
        try:
            rows.append(run_variant(args, name, hf_config, device))
        except Exception:  # noqa: BLE001 - report and go on with the other variants
            print(f"[rank {rank}] variant {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    if rank == 0:
        print("| variant | layout | step (s) | tokens/step | micro-batches/rank | tokens/s | TFLOP/s | MFU | peak mem/GPU (GiB) | build (s) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['variant']} | {r['layout']} | {r['step_s']:.3f} | {r['tokens_per_step']:.0f} | {r['micro_batches']:.0f} | "
                  f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.1f} | {r['build_s']:.1f} |",
                  flush=True)
        for r in rows:
            if r["kernels"]:
                print(f"{r['variant']}: {r['kernels']}")
            if "cuda_graph_buckets" in r:
                print(f"{r['variant']}: {r['cuda_graph_buckets']} micro-batch shape bucket(s), "
                      f"{r['cuda_graphs_captured']} CUDA graph(s) captured (warm-up included)")
        shape = shape_label(args)
        path = results_log.append(rows, bench="bench_train_megatron", gpus=world,
                                  config=f"{shape}, {args.micro_batches} x {args.mb_tokens} tokens/step/DP rank, lengths "
                                         f"[{args.min_len}, {args.max_len}], steps {args.steps} (+{args.warmup} warm-up)")
        print(f"rows appended to {path}")
    dist.destroy_process_group()
    return 0 if len(rows) == len(variants) else 1


def _spawned(rank: int, world: int, port: int, args) -> None:
    if worker(rank, world, port, args):
        raise SystemExit(1)


def main(argv=None) -> int:
    args = parse_args(argv)
    use_expandable_segments()  # torch's allocator as rlcore.run sets it up, before CUDA starts (the ranks inherit it)
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: use --tiny for the CPU smoke run", file=sys.stderr)
        return 2
    if args.tiny:
        args.mb_tokens, args.min_len, args.max_len = min(args.mb_tokens, 256), min(args.min_len, 16), min(args.max_len, 128)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("nccl" if not args.tiny else "gloo")
        return worker(dist.get_rank(), dist.get_world_size(), 0, args)
    variants = args.variants.split(",") + (["fsdp2-compile"] if args.with_fsdp2 and "fsdp2-compile" not in args.variants else [])
    # A failed graph capture leaves the CUDA generator unusable in its process (the next variant's
    # model init then fails): graphed variants get their own processes too.
    graphed = any(MEGATRON_VARIANTS.get(v, {}).get("cuda_graph") == "micro_batch" for v in variants)
    isolate = args.isolate if args.isolate is not None else ((args.shape == "qwen3moe" or graphed) and not args.tiny)
    if isolate and len(variants) > 1:
        return min(1, results_log.run_each(__file__, sys.argv[1:] if argv is None else argv,
                                           ("--variants", "--with-fsdp2", "--isolate", "--no-isolate"),
                                           [["--variants", v] for v in variants]))
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
