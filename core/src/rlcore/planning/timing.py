"""Step time by phase for one layout: generation, refit, logprobs, training, offload (seconds).

Training and logprobs: FLOPs (``6 N_active T`` plus causal attention ``6 L q T s``; forward a third)
over the GPUs at a calibrated efficiency, a pipeline's bubble ``(pp-1)/(vpp m)``, a host cost per
micro-batch, and the bytes of the collectives over the link they cross (NVLink inside a node, the
network across): tensor-parallel all-reduces, expert all-to-alls, context-parallel KV exchange, the
data-parallel gradient reduce-scatter and parameter all-gather (FSDP: per micro-batch), the part of
the overlappable ones not hidden behind compute. Generation: an engine's decode steps are its tokens in
full batches and then its longest response's tail; each step reads the engine's weights and the KV cache
of the sequences in flight from memory (or computes their GEMMs, whichever is slower) plus a host cost per
step; prefill is FLOPs. Refit: bytes into the engine plus a fixed cost (and, for LoRA, the trainer's merge of the
adapters into the base weights before they leave). PPO's critic: its values and
training passes (:mod:`rlcore.planning.critic`). The step: the sum, or one step off the longer of
generation and the trainer's side (:func:`step_s`).
"""

from __future__ import annotations

import math

from rlcore.planning import critic
from rlcore.planning.calibration import Calibration
from rlcore.planning.hardware import Cluster
from rlcore.planning.layout import Layout, Workload, micro_batches
from rlcore.planning.memory import Memory, kv_bytes_per_gpu
from rlcore.planning.shapes import ModelShape


def _ring(bytes_: float, group: int, gbps: float, cal: Calibration) -> float:
    """Seconds of a ring all-reduce (or reduce-scatter + all-gather) of ``bytes_`` over ``group`` ranks."""
    return 0.0 if group <= 1 else 2 * (group - 1) / group * bytes_ / (gbps * 1e9 * cal.comm_efficiency)


def _flops(shape: ModelShape, work: Workload, forward_only: bool) -> float:
    """Matmul FLOPs of a pass over the step's tokens: 2 a weight and token forward; training adds the input's
    gradient (2) and the weight's (2), which a LoRA run's frozen base skips (its adapters' are negligible)."""
    mult = 2 if forward_only else 6
    weights = 2 if forward_only else (4 if work.lora_params else 6)
    return weights * shape.active_matmul_params * work.tokens + mult * shape.layers * shape.q_dim * work.sum_sq


def _pass_s(shape: ModelShape, work: Workload, lay: Layout, cluster: Cluster, cal: Calibration, *, forward_only: bool) -> float:
    world, dp = lay.train_world(cluster.world), lay.dp(cluster.world)
    budget = lay.logprob_mb_tokens if forward_only else lay.train_mb_tokens
    n_mb, mb_tokens = micro_batches(work, budget, work.tokens / dp)
    flops = _flops(shape, work, forward_only)
    if lay.recompute == "full" and not forward_only:
        flops *= 4 / 3
    elif lay.recompute == "selective" and not forward_only:
        flops += 2 * shape.layers * shape.q_dim * work.sum_sq
    moe_eff = cal.fsdp2_moe_efficiency if lay.backend == "fsdp2" else cal.moe_efficiency
    dense_eff = cal.eager_efficiency if lay.backend == "fsdp2" and not work.compiled else cal.train_efficiency
    eff = cal.forward_efficiency if forward_only else (moe_eff if shape.moe else dense_eff)
    compute = flops / world / (cluster.gpu.peak_tflops * 1e12 * eff)
    if lay.pp > 1:
        compute *= 1 + (lay.pp - 1) / (lay.vpp * n_mb)
    host = n_mb * cal.per_microbatch_s * (1 if lay.pp == 1 else 1 + (lay.pp - 1) / n_mb)
    return compute + host + _comm_s(shape, work, lay, cluster, cal, n_mb, mb_tokens, forward_only)


def _comm_s(shape, work, lay, cluster, cal, n_mb, mb_tokens, forward_only) -> float:
    b, layers = work.dtype_bytes, shape.layers / lay.pp
    tokens = mb_tokens / lay.cp
    directions = 1 if forward_only else (3 if lay.recompute == "full" else 2)
    tp_bytes = tokens * shape.hidden * b
    tp = n_mb * layers * 2 * directions * _ring(tp_bytes, lay.tp, cluster.bandwidth_gbps(lay.tp), cal) / 2
    ep = 0.0
    if shape.moe and lay.ep > 1:
        a2a = tokens * shape.topk * shape.hidden * b * (lay.ep - 1) / lay.ep
        ep = n_mb * layers * 2 * directions * a2a / (cluster.bandwidth_gbps(lay.ep * lay.etp) * 1e9 * cal.comm_efficiency)
    cp = 0.0
    if lay.cp > 1:
        kv = tokens * 2 * shape.kv_dim * b * (lay.cp - 1)
        cp = n_mb * layers * directions * kv / (cluster.bandwidth_gbps(lay.cp, lay.tp) * 1e9 * cal.comm_efficiency)
    overlappable = cp
    dp = lay.dp(cluster.world)
    if not forward_only and dp > 1:
        local = shape.total_params / (lay.tp * lay.pp)
        if shape.moe:
            local = (shape.total_params - shape.expert_total_params) / (lay.tp * lay.pp)
        dp_gbps = cluster.bandwidth_gbps(dp, lay.tp * lay.cp)
        if lay.backend == "fsdp2":  # per micro-batch: gather bf16 params (forward, backward), reduce-scatter fp32 grads
            overlappable += n_mb * _ring(local * (2 * b + 4) / 2, dp, dp_gbps, cal)
        else:
            overlappable += _ring(local * work.grad_bytes / 2 + local * b / 2, dp, dp_gbps, cal)
    expert_dp = lay.train_world(cluster.world) // (lay.ep * lay.etp * lay.pp)
    if not forward_only and shape.moe and expert_dp > 1:  # expert gradients over the ranks holding the same experts
        local = shape.expert_total_params / (lay.ep * lay.etp * lay.pp)
        gbps = cluster.bandwidth_gbps(expert_dp, lay.ep * lay.etp)
        overlappable += _ring(local * work.grad_bytes / 2 + local * b / 2, expert_dp, gbps, cal)
    hidden = cal.comm_overlap if (lay.backend == "fsdp2" or work.overlap_grad_reduce or lay.cp > 1) else 0.0
    return tp + ep + overlappable * (1 - hidden)


def decode_steps(work: Workload, per_replica: int, concurrent: int) -> int:
    """Decode steps of one engine: its tokens in batches of ``concurrent`` (continuous batching refills a slot
    as a sequence ends), then the tail: its longest response goes on after the mean-length ones finished,
    and no engine finishes before its longest response."""
    mean, longest = work.response_tokens, work.longest_response
    return max(longest, math.ceil(per_replica * mean / concurrent) + longest - mean)


def generation_s(shape: ModelShape, work: Workload, lay: Layout, cluster: Cluster, cal: Calibration, mem: Memory) -> tuple[float, int]:
    """(seconds, sequences an engine decodes at once) for a step's ``samples`` over the engine replicas.

    Every replica is taken to get sequences as long as the step's longest (the decode tail bounds each
    engine); the KV cache read over the step is each sequence's own, summed over its decode steps."""
    replicas = lay.gen_replicas(cluster.world)
    per_replica = math.ceil(work.samples / replicas)
    kv_token = kv_bytes_per_gpu(shape, work, lay.gen_tp)
    # vLLM's cache is paged: a sequence holds blocks for the tokens it has so far, so a full cache of C tokens holds
    # C / (p + r/2) sequences over their lives (each occupies p*r + r^2/2 token-steps of it): a short cache means
    # more decode steps, each reading the weights once and a full cache's KV, not slower ones
    held = work.prompt_tokens + work.response_tokens / 2
    fits = int(mem.engine_kv_gib * 2**30 / max(kv_token * held, 1))
    concurrent = max(1, min(work.max_num_seqs, per_replica, fits))
    steps = decode_steps(work, per_replica, concurrent)
    in_flight = per_replica * work.response_tokens / steps  # sequences a decode step advances, on average
    gpu = cluster.gpu
    weights = shape.total_params * work.dtype_bytes / lay.gen_tp
    if shape.moe:  # a decode step touches the experts its tokens chose: at most all of them
        touched = min(1.0, in_flight * shape.topk / shape.experts)
        weights = (shape.total_params - shape.expert_total_params * (1 - touched)) * work.dtype_bytes / lay.gen_tp
    # a sequence's decode step t reads its prompt's and t response tokens' KV: summed, p*r + r^2/2 per sequence
    kv_read = per_replica * (work.prompt_tokens * work.response_tokens + work.response_tokens ** 2 / 2) * kv_token / steps
    memory_s = (weights + kv_read) / (gpu.hbm_tbps * 1e12 * cal.decode_bandwidth_efficiency)
    compute_s = 2 * shape.active_matmul_params * in_flight / lay.gen_tp / (gpu.peak_tflops * 1e12 * cal.decode_flops_efficiency)
    tp_s = 0.0 if lay.gen_tp == 1 else 2 * shape.layers * 8e-6  # two small all-reduces a layer, latency-bound
    step = cal.decode_host_ms / 1e3 + max(memory_s, compute_s) + tp_s
    prefill = 2 * shape.active_matmul_params * per_replica * work.prompt_tokens / lay.gen_tp / (gpu.peak_tflops * 1e12 * cal.prefill_efficiency)
    return steps * step + prefill, concurrent


def refit_s(shape: ModelShape, work: Workload, lay: Layout, cluster: Cluster, cal: Calibration, mem: Memory) -> float:
    """Colocated, the phase starts with the engine's wake-up, which maps its KV cache back (a larger engine
    share wakes slower), then moves the weights into it; on GPUs of its own, the weights cross the link."""
    per_engine = shape.total_params * work.dtype_bytes / lay.gen_tp
    # LoRA: each trainer rank merges its shard of the base weights with the adapters before they leave
    merge = shape.total_params * work.dtype_bytes / (lay.tp * lay.pp) / (cal.lora_merge_gbps * 1e9) if work.lora_params else 0.0
    if lay.colocated:
        return cal.refit_fixed_s + merge + per_engine / (cal.refit_gbps * 1e9) + mem.engine_kv_gib / cal.wake_gibps
    gbps = cluster.gpu.network_gbps if cluster.nodes > 1 else cluster.gpu.link_gbps
    return cal.refit_fixed_s + merge + shape.total_params * work.dtype_bytes / (gbps * 1e9 * cal.comm_efficiency)


def offload_s(mem: Memory, lay: Layout, work: Workload, cal: Calibration) -> float:
    """Colocated, with the trainer's state released while the engine is awake (Megatron's ``offload``, FSDP2's
    ``release``): gradients and optimizer state to host and back each step."""
    if not (lay.releases_state and lay.colocated and work.generation):
        return 0.0
    moved = (mem.train_parts["optimizer"] + mem.train_parts["gradients"]) * 2**30
    return 2 * moved / (cal.offload_gbps * 1e9)


def phases(shape: ModelShape, work: Workload, lay: Layout, cluster: Cluster, cal: Calibration, mem: Memory) -> dict:
    out = {"training": _pass_s(shape, work, lay, cluster, cal, forward_only=False)}
    out["logprobs"] = work.logprob_passes * _pass_s(shape, work, lay, cluster, cal, forward_only=True) if work.logprob_passes else 0.0
    if lay.backend == "fsdp2" and lay.offload:  # every step's state crosses PCIe (FSDP2 CPU offload)
        local = shape.total_params / (lay.tp * lay.dp(cluster.world))
        out["training"] += local * 16 / (cal.offload_gbps * 1e9)
    if work.generation:
        out["generation"], _ = generation_s(shape, work, lay, cluster, cal, mem)
        out["refit"] = refit_s(shape, work, lay, cluster, cal, mem)
        out["offload"] = offload_s(mem, lay, work, cal)
    if work.critic:
        model = work.critic_model or shape.as_critic()
        extra = critic.phases(model, work, lay, cluster, cal, lambda fwd: _pass_s(model, work, lay, cluster, cal, forward_only=fwd))
        out["offload"] = out.get("offload", 0.0) + extra.pop("offload", 0.0)
        out.update(extra)
    return out


TRAINER_SIDE = ("logprobs", "training", "values", "critic")


def step_s(phases: dict, overlapped: bool) -> float:
    """A synchronous step is the sum of its phases. One step off, with the engines on GPUs of their own, the
    trainer's side of step k (logprobs, the critic, training) runs while step k+1 generates: the step is the
    longer of the two, plus the refit between them (the engines wait for the new weights)."""
    if not overlapped:
        return sum(phases.values())
    trainer = sum(phases.get(p, 0.0) for p in TRAINER_SIDE)
    rest = sum(v for k, v in phases.items() if k not in TRAINER_SIDE and k != "generation")
    return max(phases.get("generation", 0.0), trainer) + rest
