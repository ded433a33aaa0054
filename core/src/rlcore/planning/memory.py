"""Memory per GPU by part, for the busiest GPU of a layout (GiB).

Training phase: weights, gradients and optimizer state of the rank's shard; the activations kept for
backward of the micro-batches in flight (one, or a pipeline's ``pp`` on its first stage); the logits of
one micro-batch (last stage); collective buffers; a sleeping colocated engine's remainder. Generation
phase (colocated): the trainer's resident state (its gradients and optimizer state leave for host memory
when released: ``colocated.offload_trainer_state``), what the refit allocates while the engine is awake (a
staged chunk, the probe's logprob pass), beside the engine's weights, KV cache and overhead; an engine
sized automatically gets twice the KV cache the step needs, within what is left. Logprob passes hold a forward's
activations only and never exceed training. Activation bytes per token and layer follow the tensors
Megatron-Core keeps for backward (its paper's count, with flash attention's linear memory):
``8h`` replicated over tensor-parallel ranks without sequence parallelism, ``2(q+2kv) + 2q + 6f`` split; an
uncompiled FSDP2 model keeps a Hugging Face layer's eager tensors (:func:`activation_bytes_per_token_layer`). The
logits: the bf16 rows the chunked logprob keeps and their bf16 gradient.
"""

from __future__ import annotations

import math

import attrs
from attrs import frozen

from rlcore.planning.calibration import Calibration
from rlcore.planning.hardware import Cluster
from rlcore.planning.layout import Layout, Workload, micro_batches
from rlcore.planning.shapes import ModelShape

GIB = float(2**30)


@frozen
class Memory:
    parts: dict  # name -> GiB at the peak phase
    phase: str  # "training" or "generation"
    peak_gib: float
    limit_gib: float
    engine_kv_gib: float  # KV cache the engine gets (colocated or its own GPUs)
    engine_fraction: float  # the engine's share of a GPU (vLLM gpu_memory_utilization)
    problem: str | None  # why it does not fit, None when it does
    train_parts: dict  # the training phase's parts (GiB)
    gen_parts: dict = attrs.Factory(dict)  # the generation phase's parts (GiB; empty without a generator)
    kv_need_gib: float = 0.0  # KV cache for every sequence of a step decoding at once (per engine GPU)

    @property
    def kv_short(self) -> bool:
        """The engine's KV cache holds fewer sequences than a step decodes at once (it then takes turns)."""
        return self.engine_kv_gib < self.kv_need_gib

    @property
    def fits(self) -> bool:
        return self.problem is None

    def better_released(self, released: Memory) -> bool:
        """Whether the trainer's state leaving the GPU while the engine is awake (``released``) is the better plan
        than keeping it (this one): kept, the engine gets less KV cache than a step's sequences need at once (or
        generation does not fit), and released fits with more (``offload_trainer_state: auto``)."""
        short = self.kv_short or (self.problem or "").startswith("generation")
        return short and released.fits and (not self.fits or released.engine_kv_gib > self.engine_kv_gib)

    @property
    def largest(self) -> str:
        return max(self.parts, key=self.parts.get)


def _local_params(shape: ModelShape, lay: Layout, stage: str) -> tuple[float, float]:
    """(dense, expert) parameters on one rank of the first or last pipeline stage."""
    layers = shape.layers / (lay.pp * 1.0)
    dense = layers * shape.dense_layer_params
    embed = shape.vocab * shape.hidden
    if lay.pp == 1:
        dense += shape.embedding_params
    elif stage == "first" or not shape.tied:
        dense += embed
    expert = layers * shape.routed_layer_params / (lay.ep * lay.etp)
    return dense / lay.tp, expert


def activation_bytes_per_token_layer(shape: ModelShape, lay: Layout, eager: bool = False) -> float:
    """Bytes autograd keeps for backward per token and layer. Megatron's layers (and compiled or mixture-of-experts
    FSDP2 models): its paper's count with flash attention. ``eager``: a Hugging Face dense decoder layer run module by
    module (FSDP2 uncompiled), which keeps more: each RMSNorm's float32 upcast beside its bf16 input and output
    (``12h`` for the two), the projections' outputs and rotary embedding's copies of q and k (``8q + 4kv``), and the
    gated MLP's gate, up, activation and product (``8f``); counted on the layer transformers builds."""
    h, tp = shape.hidden, lay.tp
    if eager and not shape.moe:
        return 12 * h / (tp if lay.sp else 1) + (8 * shape.q_dim + 4 * shape.kv_dim + 8 * shape.ffn) / tp
    replicated = 8 * h / (tp if lay.sp else 1)
    attention = 2 * (shape.q_dim + 2 * shape.kv_dim) + 2 * shape.q_dim
    if lay.recompute == "selective":  # core attention recomputed: its inputs are not kept
        attention = 2 * shape.q_dim
    if shape.moe:  # each token's top-k copies (permuted input, expert MLP, output), split over expert-TP ranks
        mlp = shape.topk * (4 * h + 6 * shape.moe_ffn) / lay.etp + 6 * shape.shared_ffn / tp
    else:
        mlp = 6 * shape.ffn / tp
    return replicated + attention / tp + mlp


def training_parts(shape: ModelShape, work: Workload, lay: Layout, cluster: Cluster, cal: Calibration, stage: str) -> dict:
    world = lay.train_world(cluster.world)
    dp = lay.dp(cluster.world)
    dense, expert = _local_params(shape, lay, stage)
    local = dense + expert
    b = work.dtype_bytes
    master = 4 if b < 4 else 0  # fp32 main weights beside bf16 ones
    opt_per_param = master + 4 * work.optimizer_states
    # LoRA: only the adapters (split as their base layers) have gradients and optimizer state
    adapters = work.lora_params / (lay.tp * lay.pp)
    if lay.backend == "fsdp2":  # the weights (a LoRA run's frozen base too) kept in float32, gathered in the dtype
        shard = dp
        trained = adapters if work.lora_params else local
        gathered = 0.0 if lay.offload else (local * b if dp == 1 else 2 * local / shape.layers * b)
        weights = 0 if lay.offload else (local + adapters) * 4 / shard
        grads = 0 if lay.offload else trained * 4 / shard
        optimizer = 0 if lay.offload else trained * 4 * work.optimizer_states / shard
        # FSDP2 reduces the float32 gradients on a stream of its own, one parameter group at a time: the whole model
        # in one group with one shard (no per-layer groups, rlcore_fsdp2.parallelize), else a layer's. The caching
        # allocator keeps that stream's blocks for that stream alone, beside the blocks the activations leave
        # cached on the compute stream: measured apart, 4.61 GiB at 1.2B (benchmarks/memory_peak.py's streams).
        reduce_scatter = trained * 4 if (dp == 1 and not lay.offload) else 2 * trained / shape.layers * 4
    elif work.lora_params:  # a frozen base in the dtype, with no main copy
        weights = (local + adapters) * b
        grads = adapters * work.grad_bytes
        optimizer = opt_per_param * adapters / dp
    else:
        expert_dp = max(1, world // (lay.ep * lay.etp * lay.pp))
        weights = local * b
        grads = local * work.grad_bytes
        optimizer = opt_per_param * (dense / dp + expert / expert_dp)
    _, mb_tokens = micro_batches(work, lay.train_mb_tokens, work.tokens / dp)
    tokens = mb_tokens / lay.cp
    layers = shape.layers / lay.pp
    in_flight = lay.pp if (stage == "first" and lay.pp > 1) else 1
    if lay.pp > 1 and lay.vpp > 1 and stage == "first":
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    eager = lay.backend == "fsdp2" and not work.compiled
    per_layer = activation_bytes_per_token_layer(shape, lay, eager) * cal.activation_factor
    if lay.recompute == "full":
        acts = tokens * (layers * in_flight * 2 * shape.hidden / (lay.tp if lay.sp else 1) + per_layer)
    else:
        acts = tokens * layers * in_flight * per_layer
    logits = tokens * shape.output_width / lay.tp * cal.logits_bytes if (stage == "last" or lay.pp == 1) else 0.0
    parts = {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": acts, "logits": logits}
    if lay.backend == "fsdp2":  # the copy its passes gather (freed after each), and the reduce-scatter's blocks
        parts["gathered_weights"], parts["reduce_scatter"] = gathered, reduce_scatter
    parts = {k: v / GIB for k, v in parts.items()}
    parts["comm_buffers"] = cal.comm_buffer_gib * (1 if world > 1 else 0) + (0.25 if lay.ep > 1 else 0.0)
    parts["other"] = cal.fixed_gib + (asleep_engine_gib(work, lay, cal) if lay.colocated and work.generation else 0.0)
    return parts


def asleep_engine_gib(work: Workload, lay: Layout, cal: Calibration) -> float:
    """What a colocated engine keeps on a trainer GPU while it sleeps: what its sleep leaves, and where it runs in a
    process of its own (:attr:`Workload.engine_process`, or engine TP > 1: a worker process a GPU) that process's own
    CUDA context, workspace and allocator slack, which an in-process engine shares with the trainer (``fixed_gib``,
    the calibration's part of any process on a GPU)."""
    own_process = work.engine_process or lay.gen_tp > 1
    return cal.engine_asleep_gib + (cal.fixed_gib if own_process else 0.0)


def kv_bytes_per_gpu(shape: ModelShape, work: Workload, gen_tp: int) -> float:
    """KV bytes per token on one engine GPU: key-value heads split over TP ranks (replicated past their count;
    latent attention's compressed vector whole on every rank)."""
    return shape.kv_bytes_per_token(work.dtype_bytes) / shape.kv_shards(gen_tp)


def engine_need(shape: ModelShape, work: Workload, lay: Layout, cal: Calibration, replicas: int) -> tuple[float, float]:
    """(weights, KV cache for every sequence an engine decodes at once) per engine GPU, GiB."""
    weights = shape.total_params * work.dtype_bytes / lay.gen_tp / GIB
    concurrent = min(work.max_num_seqs, math.ceil(work.samples / max(replicas, 1)))
    kv = concurrent * work.seq_tokens * kv_bytes_per_gpu(shape, work, lay.gen_tp) / GIB
    return weights, kv


ENGINE_CAP = 0.9  # the largest share of a GPU an automatically sized engine takes (vLLM's own default)
# An automatically sized engine's KV cache: up to this many times what a step's sequences need at once. More
# would not speed decoding (nothing waits for room); the rest of the GPU stays free, slack for what the model
# does not count (the engine's own process and CUDA graphs, allocator fragmentation).
KV_SLACK = 2.0


def idle_state(train: dict, lay: Layout) -> dict:
    """A model's state on the GPU between its own passes (``train``: its training parts): its weights, gradients
    and optimizer state. FSDP2 frees what its passes gather once each ends, and its optimizer step ends with
    ``zero_grad(set_to_none=True)``: its float32 shards and optimizer state alone. Megatron keeps its gradient
    buffers."""
    if lay.backend == "fsdp2":
        return {"weights": train["weights"], "gradients": 0.0, "optimizer": train["optimizer"]}
    return {"weights": train["weights"], "gradients": train["gradients"], "optimizer": train["optimizer"]}


def state_parts(train: dict, work: Workload, lay: Layout) -> dict:
    """The trainer's state kept on the GPU while a colocated engine is awake: its weights (the refit reads
    them), and its gradients and optimizer state unless they leave for host memory; a PPO critic's alike."""
    kept = idle_state(train, lay)
    if lay.releases_state:
        kept["gradients"] = kept["optimizer"] = 0.0
    if work.critic:
        kept["critic_state"] = kept["weights"] + kept["gradients"] + kept["optimizer"]
    # The policy's weights count the copy FSDP2 gathers for its passes too, on the safe side: the engine's share is
    # what the rest leaves free. The 1.2B full fine-tune's rows measure the engine awake 2 GiB (5 with a critic) under
    # the plan with it (the copy: 2.8 GiB), the 8B LoRA row (merged adapters, the state released) 12 GiB above the plan
    # without it (docs/guides/planning.md, held-out rows).
    kept["weights"] += train.get("gathered_weights", 0.0)
    if work.graph_pool and not lay.releases_state:  # a micro-batch's activations and logits, captured (released with the state)
        kept["graph_pool"] = train["activations"] + train["logits"]
    return kept


def refit_transient_gib(shape: ModelShape, work: Workload, lay: Layout, cal: Calibration) -> float:
    """What the trainer allocates while the engine is awake: one chunk of weights staged for the engine, and
    the refit probe's logprob pass (its logits dominate), which packs the probe's sequences into logprob
    micro-batches and so holds one micro-batch's logits at a time."""
    probe = min(work.probe_tokens, lay.logprob_mb_tokens) * shape.vocab / lay.tp * cal.forward_logits_bytes
    return (work.refit_chunk_bytes + probe) / GIB


def estimate(shape: ModelShape, work: Workload, lay: Layout, cluster: Cluster, cal: Calibration) -> Memory:
    """Both phases of a step on the busiest GPU. The engine's share (``gen_memory_fraction``) is the
    layout's when set; 0 sizes it: its weights, overhead and :data:`KV_SLACK` times the KV cache the step's
    sequences need at once, within what the trainer leaves free while the engine is awake less the
    calibration's headroom, and at most :data:`ENGINE_CAP` of the GPU."""
    limit = cluster.gpu.memory_gib * (1 - cal.headroom)  # what a fitting layout may use
    stages = ["first", "last"] if lay.pp > 1 else ["last"]
    train = max((training_parts(shape, work, lay, cluster, cal, s) for s in stages), key=lambda p: sum(p.values()))
    if work.critic:  # the critic's state stays beside the policy's while the policy trains (and the policy's beside
        # the critic's while the critic trains: the same parts, the critic being the policy's size)
        train["critic_state"] = sum(idle_state(train, lay).values())
    train_total = sum(train.values())
    if not work.generation:
        return Memory(train, "training", train_total, limit, 0.0, 0.0, _too_big(train, train_total, limit, "training"), train)
    replicas = lay.gen_replicas(cluster.world)
    eng_weights, kv_need = engine_need(shape, work, lay, cal, replicas)
    if lay.colocated:
        resident = {**state_parts(train, work, lay), "refit": refit_transient_gib(shape, work, lay, cal),
                    "comm_buffers": train["comm_buffers"]}
    else:
        resident = {}
    resident["other"] = cal.fixed_gib
    base = sum(resident.values())
    total_gib = cluster.gpu.memory_gib
    if lay.gen_memory_fraction > 0:  # the engine's share is set (vLLM's gpu_memory_utilization): it takes all of it
        engine_total = lay.gen_memory_fraction * total_gib
    else:
        wanted = eng_weights + cal.engine_overhead_gib + KV_SLACK * kv_need
        engine_total = max(0.0, min(limit - base, ENGINE_CAP * total_gib, wanted))
    kv = max(0.0, engine_total - eng_weights - cal.engine_overhead_gib)
    gen = {**resident, "engine_weights": eng_weights, "kv_cache": kv, "engine_other": cal.engine_overhead_gib}
    gen_total = sum(gen.values())
    one_sequence = work.max_seq * kv_bytes_per_gpu(shape, work, lay.gen_tp) / GIB
    problem = None
    if lay.gen_memory_fraction > 0 and base + engine_total > limit:
        problem = (f"generation: the trainer keeps {base:.1f} GiB while the engine takes gpu_memory_utilization "
                   f"{lay.gen_memory_fraction:g} x {total_gib:.0f} GiB")
    elif kv < max(one_sequence, 0.02 * kv_need, 0.5):
        problem = (f"generation: the engine's weights ({eng_weights:.1f} GiB) leave no room for a KV cache"
                   + (f" beside the trainer's {base:.1f} GiB" if lay.colocated else ""))
    problem = _too_big(train, train_total, limit, "training") or problem
    if lay.colocated and gen_total > train_total:
        peak_parts, phase = gen, "generation"
    else:
        peak_parts, phase = train, "training"
    fraction = min(1.0, (eng_weights + kv + cal.engine_overhead_gib) / total_gib)
    return Memory(peak_parts, phase, max(train_total, gen_total if lay.colocated else 0.0), limit, kv, round(fraction, 3),
                  problem, train, gen, kv_need)


def _too_big(parts: dict, total: float, limit: float, phase: str) -> str | None:
    if total <= limit:
        return None
    name = max(parts, key=parts.get)
    return f"{phase}: {total:.1f} GiB > {limit:.1f} GiB (largest: {name} {parts[name]:.1f} GiB)"
