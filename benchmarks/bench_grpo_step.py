"""Full GRPO steps through the production loop, reported in NeMo-RL's step-time format.

Each configuration builds a random-init model from a config (no downloads), runs
``--steps`` GRPO steps with ``rlcore.run`` (the same loop as ``rlcore run``), discards the first
``--warmup`` steps and prints one row: total step, policy training, refit, generation, logprobs,
mean generated tokens per sample, plus generated tokens per GPU-second, training MFU and refit
GB/s. Rewards come from the real ``math`` environment on synthetic arithmetic prompts; a random
model scores about 0, which changes nothing in the work a step does (responses run to
``max_new_tokens`` with ``ignore_eos``).

    python benchmarks/bench_grpo_step.py --config llama1b-fsdp2 --config llama1b-megatron   # one H200
    python benchmarks/bench_grpo_step.py --tiny                                              # CPU check
    python benchmarks/bench_grpo_step.py --config llama1b-tool-sync --config llama1b-tool-async  # multi-turn
    python benchmarks/bench_grpo_step.py --config llama1b-tool-async --config llama1b-tool-agent  # the agents' endpoint
    python benchmarks/bench_grpo_step.py --config llama1b-megatron --set policy.generation.experimental.engine_detokenize=true
    python benchmarks/bench_grpo_step.py --config llama1b-megatron-cp2 --max-new-tokens 16384 --mb-tokens 16448 --prompts 8

Several ``--config`` run one after the other, each in its own process (GPU memory of a finished
run is not reliably returned inside one process). Each row is printed and appended to
``results.jsonl`` as soon as the loop's last step ends (``bench_row_logger.py``), before the trainer
and the engine shut down, so a call's time limit that ends during a shutdown keeps the row. The
``*-tool-*`` configurations use the ``bench_tool`` environment of ``bench_multiturn_env.py`` (3 turns,
simulated tool latency).

MFU counts 6 * N_params * trained tokens + causal attention (6 * layers * hidden * tokens * mean
seq len) against 989 TFLOP/s per GPU (H200 bf16 dense datasheet).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_shapes  # noqa: E402
import results_log  # noqa: E402
from rlcore.cli.bench.models import SHAPES, build_here, llama_params  # noqa: E402  (rlcore bench's models: the same shapes)

PEAK_FLOPS = 989e12
NEMO_8B_ROW = {
    "cluster.gpus_per_node": 8, "train.num_prompts_per_step": 64, "grpo.num_generations_per_prompt": 32,
    "policy.train_global_batch_size": 512, "policy.max_total_sequence_length": 4096,
    "policy.generation.max_new_tokens": 795, "policy.generation.num_replicas": 8,
    "policy.generation.gpu_memory_utilization": 0.3,
}
# name -> (shape, backend, overrides)
MOE_SHAPES = {"qwen3moe": False, "tiny-moe": True}  # name -> tiny
# The 8-layer MoE's training state (bf16 and fp32 weights, AdamW's moments, fp32 gradients: about
# 101 GB) and the engine's 42 GiB do not fit one H200 together: the state goes to host memory
# while the engine is awake (first tried without: vLLM's wake-up ran out of memory).
MOE_RUN = {"policy.train_global_batch_size": 128, "policy.megatron_cfg.empty_unused_memory_level": 1,
           "policy.generation.gpu_memory_utilization": 0.3, "policy.generation.colocated.offload_trainer_state": True}
TWO_CPU_RANKS = {"cluster.cpu_workers": 2, "cluster.use_ray": True, "policy.train_global_batch_size": 8}
TOOL_ENV = {"env": {"name": "bench_tool", "bench_tool": {"max_turns": 3, "tool_latency_s": 0.5}}, "train.val_period": 0}
# The realistic multi-turn workload (bench_multiturn_env.py, heavy_tailed): 3 to 5 turns, each turn's
# length lognormal in 32..2048 tokens (enforced as its max_tokens: ignore_eos, no stop strings), tool
# latencies lognormal with median 0.5 s and p99 8 s, all seeded per (sample, trajectory, turn).
HEAVY_TOOL_ENV = {"env": {"name": "bench_tool", "bench_tool": {
    "workload": "heavy_tailed", "min_turns": 3, "max_turns": 5, "turn_stop_strings": [], "turn_tokens_median": 192,
    "turn_tokens_sigma": 1.0, "turn_tokens_range": [32, 2048], "latency_median_s": 0.5, "latency_p99_s": 8.0}},
    "train.val_period": 0, "policy.generation.max_new_tokens": 2048}
BARRIER = {"env.bench_tool.turn_barrier": True}
ASYNC_ENGINE = {"policy.generation.async_engine": True}
# The same workload as an agent through the OpenAI-compatible endpoint (bench_agent.py): against *-tool-async, the endpoint's overhead.
TOOL_AGENT = {"env": {"name": "agent", "agent": {"function": f"{Path(__file__).with_name('bench_agent.py')}:agent", "max_turns": 3}},
              "train.val_period": 0, "policy.generation.async_engine": True}

ONE_STEP_OFF = {"algorithm.rollout_correction": {"preset": "token_tis"}}
LORA_8B = {"policy.lora": {"enabled": True, "rank": 16, "alpha": 32.0}}

CONFIGS = {
    "tiny-fsdp2": ("tiny", "fsdp2", {}),
    "tiny-fsdp2-async": ("tiny", "fsdp2", {"grpo.async_grpo.enabled": True}),
    "tiny-megatron": ("tiny", "megatron", {}),
    "llama1b-fsdp2": ("llama1b", "fsdp2", {}),
    "llama1b-megatron": ("llama1b", "megatron", {}),
    # PPO (rlcore.algorithms.ppo): the same step with a critic of the policy's shape on the trainer's
    # ranks, its values and critic-training phases timed beside the policy's (values_s, critic_train_s)
    "tiny-fsdp2-ppo": ("tiny", "fsdp2", {"algorithm.name": "ppo"}),
    "tiny-megatron-ppo": ("tiny", "megatron", {"algorithm.name": "ppo"}),
    # The policy's and the critic's training state (about 40 GB at 1.2B) stay beside the engine: the run's
    # memory plan sizes the engine's share from what they leave.
    "llama1b-fsdp2-ppo": ("llama1b", "fsdp2", {"algorithm.name": "ppo"}),
    "llama1b-megatron-ppo": ("llama1b", "megatron", {"algorithm.name": "ppo"}),
    "llama1b-fsdp2-compile": ("llama1b", "fsdp2", {"policy.dtensor_cfg.compile": True}),
    "llama1b-megatron-fp8": ("llama1b", "megatron", {"policy.megatron_cfg.fp8_cfg.enabled": True,
                                                     "policy.megatron_cfg.fp8_cfg.fp8_recipe": "delayed"}),
    "llama1b-megatron-no-opfuse": ("llama1b", "megatron", {"policy.megatron_cfg.use_te_op_fuser": False}),
    # training micro-batches as CUDA-graph replays (rlcore_megatron.cuda_graph): padded to the 8192-token budget
    "llama1b-megatron-cuda-graph": ("llama1b", "megatron", {"policy.megatron_cfg.cuda_graph": "micro_batch"}),
    # One step off with the training micro-batches as graph replays and the engine core in its own process:
    # little host work left in the trainer, whose GPU gaps the engine's process fills by time-slicing. (With
    # the engine core in this process on a high-priority stream it crashed with an illegal memory access.)
    "llama1b-megatron-async-cuda-graph": ("llama1b", "megatron", {"grpo.async_grpo.enabled": True, **ONE_STEP_OFF,
                                                                  "policy.megatron_cfg.cuda_graph": "micro_batch"}),
    # The same sharing the GPU the best way measured (needs an MPS daemon): the trainer's
    # context below the engine's priority, its GEMMs leaving half of the H200's 132 SMs, one collection a step.
    "llama1b-megatron-async-shared": ("llama1b", "megatron", {
        "grpo.async_grpo.enabled": True, **ONE_STEP_OFF, "policy.megatron_cfg.cuda_graph": "micro_batch",
        "experimental.trainer_mps_priority": "below_normal", "policy.megatron_cfg.experimental.gemm_sm_margin": 66, "cluster.gc_period": 1}),
    # The same with the engine core in this process: one CUDA context, so generation and training kernels can
    # run at once on their streams (two processes are time-sliced unless MPS runs). It crashed with the engine
    # on a high-priority stream; the engine now runs on vLLM's own stream.
    "llama1b-megatron-async-inproc-cuda-graph": ("llama1b", "megatron", {
        "grpo.async_grpo.enabled": True, **ONE_STEP_OFF, "policy.megatron_cfg.cuda_graph": "micro_batch",
        "policy.generation.experimental.engine_process": False}),
    # One step off, with the correction for one step of staleness (token-level truncated IS).
    "llama1b-fsdp2-async": ("llama1b", "fsdp2", {"grpo.async_grpo.enabled": True, **ONE_STEP_OFF}),
    "llama1b-megatron-async": ("llama1b", "megatron", {"grpo.async_grpo.enabled": True, **ONE_STEP_OFF}),
    # The async engine core in this process (engine_process: false): the rollout thread and the
    # trainer share one interpreter lock. And a sync step with the engine core in its own process.
    "llama1b-megatron-async-inproc": ("llama1b", "megatron", {"grpo.async_grpo.enabled": True, **ONE_STEP_OFF,
                                                              "policy.generation.experimental.engine_process": False}),
    "llama1b-megatron-engine-process": ("llama1b", "megatron", {"policy.generation.experimental.engine_process": True}),
    # FP8 rollouts (issue 24): vLLM's online FP8 re-quantizes every refit's bf16 weights as they
    # load; token-level truncated IS corrects for the wider generator-trainer gap.
    "llama1b-megatron-fp8gen": ("llama1b", "megatron", {"policy.generation.quantization": "fp8",
                                                        "algorithm.rollout_correction": {"preset": "token_tis"}}),
    # empty_unused_memory_level 1: the trainer returns its cached activation memory after each
    # optimizer step, so the colocated engine's wake-up (42 GiB on GPU 0) finds it free.
    "llama8b-megatron-tp2": ("llama8b", "megatron", {"policy.megatron_cfg.tensor_model_parallel_size": 2, "cluster.gpus_per_node": 2,
                                                      "policy.megatron_cfg.empty_unused_memory_level": 1,
                                                      "policy.generation.gpu_memory_utilization": 0.3}),
    "llama8b-fsdp2": ("llama8b", "fsdp2", {"cluster.gpus_per_node": 2, "policy.generation.gpu_memory_utilization": 0.3}),
    # LoRA on one 80 GB GPU: rank-16 adapters on every projection, 32 prompts x 8 samples x 1024 tokens, the engine
    # colocated. Megatron keeps the frozen base in bf16 (no main copy, no optimizer state for it); fsdp2 in its
    # float32 master dtype, gathered in bf16, and recomputes each layer's activations (an 8192-token micro-batch's
    # activations of all 32 layers, about 36 GiB, do not fit beside the 30 GiB base).
    # Shapes no calibration read (the planner's held-out rows): a 0.5B Llama with Qwen2.5-0.5B's widths, fully
    # fine-tuned, and Llama-3.2-3B's shape with LoRA (its full fine-tune does not fit one 80 GB GPU)
    "llama0.5b-megatron": ("llama0.5b", "megatron", {}),
    "llama0.5b-fsdp2": ("llama0.5b", "fsdp2", {}),
    "llama3b-megatron-lora": ("llama3b", "megatron", LORA_8B),
    "llama3b-fsdp2-lora": ("llama3b", "fsdp2", LORA_8B),
    "llama8b-megatron-lora": ("llama8b", "megatron", LORA_8B),
    "llama8b-fsdp2-lora": ("llama8b", "fsdp2", {**LORA_8B, "policy.dtensor_cfg.activation_checkpointing": True}),
    # NeMo-RL's published Llama 3.1-8B row (issue 10): 2048 rollouts (64 prompts x 32), global
    # batch 512, max sequence 4096, ~795 generated tokens a sample, colocated, 8 GPUs.
    "llama8b-nemo-8gpu-megatron": ("llama8b", "megatron", {**NEMO_8B_ROW, "policy.megatron_cfg.tensor_model_parallel_size": 2}),
    "llama8b-nemo-8gpu-fsdp2": ("llama8b", "fsdp2", NEMO_8B_ROW),
    # Non-colocated on two GPUs: one GPU trains (Ray actor), one generates (driver), refit by
    # NCCL broadcast from the trainer's process. 1.2B: an 8B model's fp32 master weights, gradients
    # and Adam state (~128 GB) do not fit one H200 without offloading.
    "llama1b-fsdp2-noncolocated": ("llama1b", "fsdp2", {
        "cluster.gpus_per_node": 2, "policy.generation.colocated": {"enabled": False, "resources": {"gpus_per_node": 1}},
        "policy.generation.gpu_memory_utilization": 0.85}),
    # The 8B shape non-colocated: its trainer keeps fp32 params, gradients and Adam state in host
    # memory (FSDP2 CPUOffloadPolicy), the only way this backend fits 8B training on one H200.
    # Megatron's optimizer offload needs its precision-aware optimizer, which megatron-core 0.16.1
    # cannot configure without Transformer Engine (not on these machines).
    "llama8b-fsdp2-noncolocated": ("llama8b", "fsdp2", {
        "cluster.gpus_per_node": 2, "policy.generation.colocated": {"enabled": False, "resources": {"gpus_per_node": 1}},
        "policy.generation.gpu_memory_utilization": 0.85, "policy.dtensor_cfg.cpu_offload": True}),
    # Multi-turn (issue 9): 3 model turns with simulated tool calls between them
    # (benchmarks/bench_multiturn_env.py), vLLM's sync engine (batches of whatever is queued)
    # against the async engine (continuous batching, each turn scheduled when its tool returns).
    "tiny-tool-sync": ("tiny", "fsdp2", TOOL_ENV),
    "tiny-tool-async": ("tiny", "fsdp2", {**TOOL_ENV, "policy.generation.async_engine": True}),
    "llama1b-tool-sync": ("llama1b", "megatron", TOOL_ENV),
    "llama1b-tool-async": ("llama1b", "megatron", {**TOOL_ENV, "policy.generation.async_engine": True}),
    # The heavy-tailed workload (issue 58), each engine with and without the turn barrier (every
    # trajectory's next turn waits for all trajectories' current one: the batched synchronous baseline).
    # 32 prompts x 8 samples = 256 trajectories; run the four in one call.
    **{f"{shape}-multiturn-{engine}{'-barrier' if barrier else ''}": (
        shape, "megatron" if shape == "llama1b" else "fsdp2",
        {**HEAVY_TOOL_ENV, **(ASYNC_ENGINE if engine == "async" else {}), **(BARRIER if barrier else {})})
       for shape in ("tiny", "llama1b") for engine in ("sync", "async") for barrier in (False, True)},
    "tiny-tool-agent": ("tiny", "fsdp2", TOOL_AGENT),
    "llama1b-tool-agent": ("llama1b", "megatron", TOOL_AGENT),
    # Long context (issue 9): context parallelism 2 over two GPUs; run with
    # --max-new-tokens 16384 --mb-tokens 16448 --prompts 8 (16k-token sequences, 64 samples a step).
    # fsdp2 has no context parallelism (its config rejects context_parallel_size > 1).
    "llama1b-megatron-cp2": ("llama1b", "megatron", {"policy.megatron_cfg.context_parallel_size": 2, "cluster.gpus_per_node": 2,
                                                      "policy.generation.gpu_memory_utilization": 0.4}),
    "tiny-megatron-cp2": ("tiny", "megatron", {"policy.megatron_cfg.context_parallel_size": 2, "cluster.cpu_workers": 2,
                                               "cluster.use_ray": True}),
    # The same shape of run at tiny scale on CPU: 8 gloo trainer processes (Ray actors).
    "tiny-8rank-fsdp2": ("tiny", "fsdp2", {"cluster.cpu_workers": 8, "cluster.use_ray": True, "policy.train_global_batch_size": 8}),
    "tiny-8rank-megatron": ("tiny", "megatron", {"cluster.cpu_workers": 8, "cluster.use_ray": True, "policy.train_global_batch_size": 8}),
    # Mixture of experts (issue 23): Qwen3-30B-A3B's layer at 8 layers (moe_shapes.py) on one H200,
    # colocated vLLM (its fused MoE kernels), expert weights refit in Hugging Face names. Two
    # optimizer steps a GRPO step, so the second meets weights the old-logprob pass never saw:
    # moe/routing_mismatch_fraction measured without replay, then with R2.
    "qwen3moe-megatron": ("qwen3moe", "megatron", {"policy.megatron_cfg.moe_routing_metrics": True, **MOE_RUN}),
    "qwen3moe-megatron-r2": ("qwen3moe", "megatron", {"policy.megatron_cfg.moe_router_replay": "r2", **MOE_RUN}),
    "qwen3moe-megatron-r3": ("qwen3moe", "megatron", {"policy.megatron_cfg.moe_router_replay": "r3",
                                                      "policy.generation.return_routed_experts": True, **MOE_RUN}),
    "qwen3moe-fsdp2": ("qwen3moe", "fsdp2", MOE_RUN),
    "tiny-moe-megatron-r2": ("tiny-moe", "megatron", {"policy.megatron_cfg.moe_router_replay": "r2",
                                                      "policy.train_global_batch_size": 8}),
    # The two-GPU configurations of issue 29 at tiny scale on CPU: two gloo trainer ranks (Ray actors).
    "tiny-megatron-tp2-sp": ("tiny", "megatron", {"policy.megatron_cfg.tensor_model_parallel_size": 2,
                                                  "policy.megatron_cfg.sequence_parallel": True, **TWO_CPU_RANKS}),
    "tiny-megatron-dp2": ("tiny", "megatron", {"policy.megatron_cfg.optimizer.use_distributed_optimizer": True, **TWO_CPU_RANKS}),
    "tiny-fsdp2-dp2": ("tiny", "fsdp2", TWO_CPU_RANKS),
    "tiny-moe-megatron-ep2": ("tiny-moe", "megatron", {"policy.megatron_cfg.expert_model_parallel_size": 2,
                                                       "policy.megatron_cfg.moe_router_replay": "r2", **TWO_CPU_RANKS}),
    "tiny-fsdp2-async-noncolocated": ("tiny", "fsdp2", {"grpo.async_grpo.enabled": True, "policy.generation.colocated": {"enabled": False},
                                                        **TWO_CPU_RANKS}),
}


def build_model(shape: str, root: Path, gpu: bool) -> Path:
    """The random-init checkpoint of ``shape`` under ``root`` (built once). Real sizes are built on
    the GPU in a child process: this (driver) process must not hold GPU memory or have initialised
    CUDA before the run places its trainer and engine (seen: an 8B model built here left ~16 GiB
    cached on GPU 0 and vLLM's wake-up then ran out of memory)."""
    path = root / f"model-{shape}"
    if not (path / "config.json").is_file():
        if shape not in ("tiny", "tiny-moe") and gpu:
            subprocess.run([sys.executable, __file__, "--build-model", shape, "--workdir", str(root)], check=True)
        else:
            _build_model_here(shape, path, device=None)
    return path


def _build_model_here(shape: str, path: Path, device: str | None) -> None:
    if shape in MOE_SHAPES:
        _build_moe_model(shape, path, device)
        return
    build_here(shape, shape, path, device)  # bf16 with transformers' init at real size, float32 N(0, 0.05) tiny


def _build_moe_model(shape: str, path: Path, device: str | None) -> None:
    """Random-init Qwen3-MoE of ``moe_shapes.qwen3moe_config`` (transformers' own init), bf16 at real size."""
    import torch
    from rlcore.testing.tiny import build_tokenizer
    from transformers import AutoModelForCausalLM

    tiny = MOE_SHAPES[shape]
    config = moe_shapes.qwen3moe_config(tiny=tiny)
    if tiny:
        config.vocab_size = 128
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if tiny else torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(config.vocab_size).save_pretrained(path)


def gpu_available() -> bool:
    """Whether a GPU is present, asked through NVML: ``torch.cuda.is_available()`` initialises the CUDA
    driver with this moment's ``CUDA_VISIBLE_DEVICES`` (the non-colocated placement narrows it later)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()


MPS_CLIENT_PRIORITIES = ("normal", "below-normal")  # experimental.trainer_mps_priority's values, spelled as flags


def make_trainer_mps_context(percent: int, priority: str | None) -> None:
    """Create this process's CUDA context (the trainer's) under MPS with an SM cap, and the client priority
    with it if asked (without a cap the priority is ``experimental.trainer_mps_priority``, which does the same).

    MPS reads ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the share of the SMs) and ``CUDA_MPS_CLIENT_PRIORITY``
    (0 normal, 1 below normal: a coarse priority between MPS clients) when a process creates its context,
    so the context is created here and the variables removed again: the processes started later (the
    model builder, vLLM's engine core) keep the whole GPU at normal priority. Under MPS without either,
    one step off at 1.2B kept the trainer near its own speed while generation stretched from about 7 to
    13 s; a cap of 50% slowed the trainer as much as time-slicing did; at 70% the trainer's logprobs
    came out wrong and the refit probe stopped the run at step 1; at 60% its losses came out non-finite.
    """
    from rlcore.controller.mps_client import PRIORITIES, create_context_with

    if not 1 <= percent <= 100:
        raise SystemExit(f"--trainer-mps-percentage: {percent} is not a percentage in 1..100")
    variables = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)}
    if priority is not None:
        variables["CUDA_MPS_CLIENT_PRIORITY"] = PRIORITIES[priority.replace("-", "_")]
    create_context_with(variables)


def size_for_turns(tree: dict, args) -> None:
    """A multi-turn environment's length limit (every turn at its token limit, with the tool's reply) and
    micro-batches that hold its longest trajectory; the CPU check's short turns (``args.tiny``). The planner's
    held-out test sizes a row's run with it too (core/tests/test_planning_heldout.py)."""
    if tree["env"]["name"] == "bench_tool":
        turns = tree["env"]["bench_tool"]["max_turns"]
        turn_tokens = tree["policy"]["generation"]["max_new_tokens"]
        if args.tiny:  # the CPU check: short turns
            turn_tokens = tree["policy"]["generation"]["max_new_tokens"] = args.max_new_tokens
            if tree["env"]["bench_tool"].get("workload") == "heavy_tailed":
                tree["env"]["bench_tool"].update(turn_tokens_median=8, turn_tokens_range=[4, args.max_new_tokens],
                                                 latency_median_s=0.01, latency_p99_s=0.1)
        longest = tree["policy"]["max_total_sequence_length"] = turns * (turn_tokens + 64) + 64
        packing = tree["policy"]["sequence_packing"]  # a micro-batch holds at least the longest trajectory
        packing["train_mb_tokens"] = max(packing["train_mb_tokens"], longest)
        packing["logprob_mb_tokens"] = max(packing["logprob_mb_tokens"], longest)
    if tree["env"]["name"] == "agent":
        tree["policy"]["max_total_sequence_length"] = tree["env"]["agent"]["max_turns"] * (args.max_new_tokens + 64) + 64


def recipe(model: Path, backend: str, run_dir: Path, args, gpu: bool) -> dict:
    shape_tokens = args.max_new_tokens
    return {
        "policy": {
            "model_name": str(model), "precision": "bfloat16" if gpu else "float32",
            "max_total_sequence_length": shape_tokens + 64,
            "optimizer": {"lr": 1e-6}, "train_global_batch_size": None,
            "sequence_packing": {"enabled": True, "train_mb_tokens": args.mb_tokens, "logprob_mb_tokens": 2 * args.mb_tokens},
            "dtensor_cfg": {"enabled": backend == "fsdp2"},
            "megatron_cfg": {"enabled": backend == "megatron"},
            "generation": {"backend": args.generator, "max_new_tokens": shape_tokens, "ignore_eos": True, "temperature": 1.0,
                           **({"dtype": "bfloat16"} if gpu else {})},
        },
        "algorithm": {"name": "grpo", "kl_coef": args.kl_coef},
        "data": {"name": "arithmetic", "digits": 3, "num_validation": 8},
        "env": {"name": "math", "math": {"executor": "process"}},
        "train": {"num_prompts_per_step": args.prompts, "max_num_steps": args.steps, "seed": 0},
        "grpo": {"num_generations_per_prompt": args.samples, "summary_window": [args.warmup + 1, args.steps]},
        "cluster": {"gpus_per_node": 1 if gpu else 0},
        "logger": {"log_dir": str(run_dir), "print_table": True},
    }


def row(name: str, shape: str, result: dict, gpus: int, args, train_gpus: int | None = None, lora: bool = False) -> dict:
    s = result["summary"]
    samples = args.prompts * args.samples
    tokens_per_sample = s.get("rollout/mean_response_tokens", 0.0)
    gen_tokens = samples * tokens_per_sample
    seq_len = tokens_per_sample + 16
    if shape in MOE_SHAPES:  # active parameters (moe_shapes.py)
        train_flops = moe_shapes.step_flops(moe_shapes.qwen3moe_config(tiny=MOE_SHAPES[shape]), [int(seq_len)] * samples)
    else:
        cfg = SHAPES[shape]
        # 6N a token (forward 2N, backward 4N); with LoRA the frozen weights get no gradient, so the backward is
        # the activations' 2N alone: 4N (the adapters' own FLOPs are under 1% at rank 16)
        weight_flops = 4 if lora else 6
        train_flops = samples * seq_len * (weight_flops * llama_params(cfg) + 6 * cfg["num_layers"] * cfg["hidden_size"] * seq_len)
    records = [r for r in result["records"] if s["window_first"] <= r.get("step", -1) <= s["window_last"]]
    # Wall seconds from the end of the step before to the end of this one: the rate a run makes steps at,
    # whatever a step's timer covers (one step off's batches come from another thread).
    ended = {r["step"]: r["time/elapsed_s"] for r in result["records"] if "time/elapsed_s" in r and "step" in r}
    periods = [ended[r["step"]] - ended[r["step"] - 1] for r in records if r["step"] - 1 in ended and r["step"] in ended]
    refit_gbps = [r["refit/gb_per_s"] for r in records if "refit/gb_per_s" in r]
    return {
        "config": name, "generator": args.generator, "gpus": gpus, "samples": samples, "max_new_tokens": args.max_new_tokens, "step_s": s.get("timing/total"), "train_s": s.get("timing/training"),
        "refit_s": s.get("timing/refit"), "generation_s": s.get("timing/generation"), "logprobs_s": s.get("timing/logprobs"),
        "offload_s": s.get("timing/offload"),  # colocated.offload_trainer_state: both directions
        "values_s": s.get("timing/values"), "critic_train_s": s.get("timing/critic_train"),  # ppo's critic phases
        "tokens_per_sample": tokens_per_sample,
        "gen_tokens_per_gpu_s": gen_tokens / (s["timing/total"] * gpus),
        "train_mfu": train_flops / (s["timing/training"] * (train_gpus or gpus) * PEAK_FLOPS) if s.get("timing/training") else None,
        "refit_gb_per_s": _mean(refit_gbps),
        "probe_mean_abs_logprob_gap": _mean([r["refit/probe_mean_abs_logprob_diff"] for r in records
                                              if "refit/probe_mean_abs_logprob_diff" in r]),
        "steps_averaged": s.get("num_steps"),
        # each averaged step's total and generation: one slow generation can move a three-step mean by
        # 1-2 s, which the means alone do not show
        "step_s_each": [round(r["timing/total"], 3) for r in records if "timing/total" in r],
        "period_s": _mean(periods), "period_s_each": [round(x, 3) for x in periods],
        "generation_s_each": [round(r["timing/generation"], 3) for r in records if "timing/generation" in r],
        "gc_s_each": [round(r["time/gc_s"], 3) for r in records if "time/gc_s" in r],
        **{key: _mean([r[key] for r in records if key in r]) for key in MEAN_KEYS if any(key in r for r in records)},
        # peak memory per phase over the window (torch's allocator, the device's NVML count) and the plan's prediction
        **{k: round(v, 2) for k, v in s.items() if k.startswith("memory/")},
        **next(({k: round(v, 3) for k, v in r.items() if k.startswith("memory_plan/")}
                for r in result["records"] if "memory_plan/training_gib" in r), {}),
    }


# Means over the summary window when the run logs them: the train-generator logprob gap (mean |log p_gen -
# log p_old| per token, and its k3 KL), the MoE routing mismatch (routing_replay.py), one step off's
# generator idle time between batches (and its parts: the wait for the trainer, then the way back to the
# generator, and how long after which release of the trainer it went on; on the trainer's side, from the
# generation's end to the refit's hold of the generator), the trainer's wait for a batch, the scoring time,
# the garbage collector's pauses of the process, and with experimental.gil_lag_probe the interpreter lock's waits.
MEAN_KEYS = ("train/gen_kl_error", "train/rollout_kl_k3", "train/moe/routing_mismatch_fraction", "moe/routing_mismatch_fraction",
             "async/generator_idle_s", "async/generator_waits_for_trainer_s", "async/generator_start_s",
             "async/generator_wake_after_done_s", "async/generator_wake_after_credit_s", "async/refit_after_generation_s",
             "async/batch_wait_s", "refit/generator_hold_s", "timing/reward",
             "time/gc_s", "time/gc_longest_s", "time/gc_full_collections", "time/gil_lag_mean_s", "time/gil_lag_max_s",
             "rollout/generated_tokens", "rollout/longest_trajectory_model_tokens", "rollout/longest_trajectory_env_s",
             "rollout/max_trajectory_env_s",
             "rollout/turn_barrier_rounds")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS))
    parser.add_argument("--tiny", action="store_true", help="CPU check: tiny shape, few tokens")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--mb-tokens", type=int, default=8192)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--generator", default="vllm")
    parser.add_argument("--workdir", default=os.environ.get("BENCH_WORKDIR", tempfile.gettempdir() + "/rlcore-bench"))
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--build-model", default=None, choices=sorted([*SHAPES, *MOE_SHAPES]), help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override applied after the configuration's own (YAML value), e.g. "
                             "policy.generation.experimental.engine_detokenize=true; the row's name shows it")
    parser.add_argument("--trainer-mps-percentage", type=int, default=None, metavar="P",
                        help="under MPS (nvidia-cuda-mps-control -d), cap the trainer's CUDA context at P%% of the "
                             "SMs; vLLM's engine process keeps all of them; the row's name shows it")
    parser.add_argument("--trainer-sm-margin", type=int, default=None, metavar="N",
                        help="SMs every GEMM of the trainer leaves free (policy.megatron_cfg.experimental.gemm_sm_margin: TE's and "
                             "torch's through cuBLASLt's SM count target), so that vLLM's kernels beside them under MPS "
                             "start at once; the row's name shows it")
    parser.add_argument("--trainer-mps-priority", choices=MPS_CLIENT_PRIORITIES, default=None,
                        help="under MPS, the trainer's client priority (CUDA_MPS_CLIENT_PRIORITY): below-normal asks "
                             "MPS to schedule vLLM's engine process (normal) ahead of the trainer (experimental.trainer_mps_priority; "
                             "with --trainer-mps-percentage the bench makes the context); the row's name shows it")
    args = parser.parse_args(argv)
    if args.build_model:  # child process of build_model
        _build_model_here(args.build_model, Path(args.workdir) / f"model-{args.build_model}", device="cuda")
        return 0
    configs = args.config or (["tiny-fsdp2"] if args.tiny else ["llama1b-fsdp2", "llama1b-megatron"])
    if len(configs) > 1:
        # One process per configuration: a finished run's engine and trainer must not hold GPU
        # memory that the next one needs (seen: vLLM found 55 of 140 GiB free at the second config).
        return run_each_in_own_process(configs, argv if argv is not None else sys.argv[1:], args.json_out)
    if args.tiny:
        args.prompts, args.samples, args.max_new_tokens, args.steps, args.warmup = 4, 4, 16, 3, 1
    import rlcore
    import yaml

    import bench_row_logger
    from rlcore.config.structure import set_dotted
    from rlcore.plugins import get_plugin_manager

    get_plugin_manager().register_module(bench_row_logger)

    gpu = gpu_available()
    if args.trainer_mps_percentage is not None:  # a cap is no key (it breaks the trainer's math): the bench makes the context
        if not gpu:
            parser.error("--trainer-mps-percentage needs a GPU (and an MPS control daemon)")
        make_trainer_mps_context(args.trainer_mps_percentage, args.trainer_mps_priority)
    root = Path(args.workdir)
    rows = []
    for name in configs:
        shape, backend, overrides = CONFIGS[name]
        model = build_model(shape, root, gpu)
        tree = recipe(model, backend, root / f"run-{name}", args, gpu)
        for key, value in overrides.items():
            set_dotted(tree, key, value)
        if args.trainer_sm_margin is not None:
            if backend != "megatron":
                parser.error(f"--trainer-sm-margin: {name} trains with {backend}; the margin is a Megatron key")
            set_dotted(tree, "policy.megatron_cfg.experimental.gemm_sm_margin", args.trainer_sm_margin)
        if args.trainer_mps_priority is not None and args.trainer_mps_percentage is None:
            set_dotted(tree, "experimental.trainer_mps_priority", args.trainer_mps_priority.replace("-", "_"))
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                parser.error(f"--set {item!r}: expected KEY=VALUE")
            set_dotted(tree, key, yaml.safe_load(value))
        if tree["env"]["name"] == "bench_tool":
            import bench_multiturn_env

            get_plugin_manager().register_module(bench_multiturn_env)
        size_for_turns(tree, args)
        # A run directory holds one run (rlcore refuses to mix a second one in): each call is new.
        shutil.rmtree(tree["logger"]["log_dir"], ignore_errors=True)
        gpus = tree["cluster"]["gpus_per_node"] or 1
        placement = tree["policy"]["generation"].get("colocated", {})
        train_gpus = gpus - (placement.get("resources", {}).get("gpus_per_node", 0) if not placement.get("enabled", True) else 0)
        label = name + (f" [{args.generator} generator]" if args.generator != "vllm" else "") + "".join(f" [{item}]" for item in args.set)
        if args.trainer_mps_percentage is not None:
            label += f" [mps trainer {args.trainer_mps_percentage}%]"
        if args.trainer_mps_priority is not None:
            label += f" [mps trainer {args.trainer_mps_priority}]"
        if args.trainer_sm_margin is not None:
            label += f" [trainer GEMMs leave {args.trainer_sm_margin} SMs]"
        started = time.perf_counter()

        lora = bool(tree["policy"].get("lora", {}).get("enabled"))

        def emit(result, label=label, shape=shape, gpus=gpus, train_gpus=train_gpus, started=started, lora=lora):
            """The row, printed and kept (results.jsonl, --json-out) before the run's shutdown begins."""
            rows.append(row(label, shape, result, gpus, args, train_gpus, lora))
            print(json.dumps(rows[-1]), f"(wall {time.perf_counter() - started:.0f}s, before shutdown)", flush=True)
            keep_rows(rows[-1:], args)

        bench_row_logger.on_loop_end = emit
        # the run's own step count and summary window, --set overrides included
        first, last = tree["grpo"]["summary_window"]
        tree["logger"]["bench_row"] = {"enabled": True, "steps": tree["train"]["max_num_steps"], "window_first": first,
                                       "window_last": last}
        rlcore.run(rlcore.build_config(tree))
        print(f"{label}: wall {time.perf_counter() - started:.0f}s with the shutdown", flush=True)
    add_bounds(rows)
    print_table(rows)
    return 0


def keep_rows(rows: list[dict], args) -> None:
    """Append ``rows`` to results.jsonl, and to ``--json-out`` (what the parent of a per-config process reads)."""
    results_log.append([{**{k: v for k, v in r.items() if k != "config"}, "variant": r["config"]} for r in rows],
                       bench="bench_grpo_step", gpus=rows[0]["gpus"],
                       config=f"{args.prompts} prompts x {args.samples} samples x {args.max_new_tokens} new tokens, "
                              f"{args.mb_tokens}-token micro-batches, steps {args.steps} (summary after {args.warmup})")
    if args.json_out:
        out = Path(args.json_out)
        kept = json.loads(out.read_text()) if out.is_file() else []
        out.write_text(json.dumps(kept + rows, indent=2))


def add_bounds(rows: list[dict]) -> None:
    """Each multi-turn row gets the two floors of its generation phase from the first single-turn row of the
    same call (its samples all run to --max-new-tokens): the token bound (the row's generated tokens at the
    single-turn row's rate) and the critical path (the trajectory with the most model tokens: its tokens times
    the single-turn row's decode step, its generation phase over --max-new-tokens, plus its tool seconds);
    ``generation_over_bound`` is the generation phase over the larger one."""
    single = [r for r in rows if r.get("rollout/generated_tokens") is None and r.get("generation_s")]
    if not single:
        return
    ref = single[0]
    rate = ref["samples"] * ref["tokens_per_sample"] / ref["generation_s"]
    decode_step_s = ref["generation_s"] / ref["max_new_tokens"]
    for r in rows:
        if r.get("rollout/generated_tokens") is None or r.get("generation_s") is None:
            continue
        r["token_bound_s"] = r["rollout/generated_tokens"] / rate
        r["critical_path_bound_s"] = r["rollout/longest_trajectory_model_tokens"] * decode_step_s + r["rollout/longest_trajectory_env_s"]
        r["generation_over_bound"] = r["generation_s"] / max(r["token_bound_s"], r["critical_path_bound_s"])
        r["bounds_from"] = ref["config"]


def print_table(rows: list[dict]) -> None:
    print("\n| config | GPUs | step (s) | train | refit | generation | logprobs | tokens/sample | gen tok/GPU-s | train MFU | refit GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    for r in rows:
        print(f"| {r['config']} | {r['gpus']} | {fmt(r['step_s'])} | {fmt(r['train_s'])} | {fmt(r['refit_s'])} | "
              f"{fmt(r['generation_s'])} | {fmt(r['logprobs_s'])} | {fmt(r['tokens_per_sample'], '{:.0f}')} | "
              f"{fmt(r['gen_tokens_per_gpu_s'], '{:.0f}')} | {fmt(r['train_mfu'], '{:.1%}')} | {fmt(r['refit_gb_per_s'], '{:.1f}')} |",
              flush=True)
    turns = [r for r in rows if r.get("rollout/generated_tokens") is not None]
    if turns:
        print("\n| multi-turn config | generation (s) | generated tokens | longest trajectory (tokens, tool s) | token bound (s) "
              "| critical path (s) | generation / bound | GC (s, full) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in turns:
            print(f"| {r['config']} | {fmt(r['generation_s'])} | {fmt(r['rollout/generated_tokens'], '{:.0f}')} | "
                  f"{fmt(r['rollout/longest_trajectory_model_tokens'], '{:.0f}')}, {fmt(r['rollout/longest_trajectory_env_s'])} | "
                  f"{fmt(r.get('token_bound_s'))} | {fmt(r.get('critical_path_bound_s'))} | {fmt(r.get('generation_over_bound'))} | "
                  f"{fmt(r.get('time/gc_s'))}, {fmt(r.get('time/gc_full_collections'), '{:.1f}')} |", flush=True)


def run_each_in_own_process(configs: list[str], argv: list[str], json_out: str | None) -> int:
    """Re-run this script once per ``--config`` and merge the rows; a failed config is reported and skipped."""
    base, skip = [], False
    for arg in argv:  # drop --config/--json-out (both spellings) from the command line
        if skip:
            skip = False
        elif arg in ("--config", "--json-out"):
            skip = True
        elif not arg.startswith(("--config=", "--json-out=")):
            base.append(arg)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            out = Path(tmp) / f"{name}.json"
            # The children's rows share this call's run id.
            proc = subprocess.run([sys.executable, __file__, *base, "--config", name, "--json-out", str(out)],
                                  env={**os.environ, "RLCORE_RUN_ID": results_log.RUN_ID})
            if proc.returncode != 0 or not out.is_file():
                failed.append(f"{name} (exit {proc.returncode})")
                continue
            rows.extend(json.loads(out.read_text()))
    add_bounds(rows)
    print_table(rows)
    if failed:
        print("failed configurations: " + ", ".join(failed), file=sys.stderr)
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
