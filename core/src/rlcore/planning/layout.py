"""What the planner chooses (:class:`Layout`) and what it plans for (:class:`Workload`)."""

from __future__ import annotations

import math

import attrs
from attrs import frozen

from rlcore.planning.shapes import ModelShape

Recompute = str  # "none" | "selective" | "full"


@frozen
class Workload:
    """One GRPO step's shape. ``response_tokens`` is the mean response, ``response_max`` the longest (the
    decode tail; 0: every response is ``response_tokens`` long); memory uses ``max_seq`` for the longest
    sequence a micro-batch holds."""

    samples: int  # sequences a step generates and trains on
    prompt_tokens: int
    response_tokens: int
    max_seq: int
    response_max: int = 0
    packing: bool = True
    micro_batch_size: int = 1  # sequences per micro-batch without packing
    logprob_passes: int = 1  # old-policy and reference passes
    generation: bool = True  # False: training alone (the training benchmarks)
    seq_sq_mean: float | None = None  # mean of len^2 over sequences (attention FLOPs); None = seq_tokens^2
    uniform_lengths: bool = True  # every sequence seq_tokens long (responses to the limit); else packing fills budgets
    max_num_seqs: int = 256  # sequences one engine decodes at once
    dtype_bytes: int = 2
    grad_bytes: int = 4  # Megatron: 4 with grad_reduce_in_fp32, else the dtype's
    optimizer_states: int = 2  # Adam: 2 moments; SGD with momentum: 1
    overlap_grad_reduce: bool = False
    critic: bool = False  # PPO: a value model of the policy's shape trains beside it (its state on the same GPUs)
    critic_model: ModelShape | None = None  # the critic's shape for its phases (None: the policy's with a value head)
    refit_chunk_bytes: int = 1 << 30  # weights staged for the engine at a time while it is awake (refit.chunk_bytes)
    probe_tokens: int = 0  # tokens the refit probe's logprob pass scores while the engine is awake
    graph_pool: bool = False  # training micro-batches replayed as CUDA graphs: their memory pool stays between steps
    one_step_off: bool = False  # asynchronous GRPO: step k+1 generates while step k trains
    # the engine runs in processes of its own (vLLM's async engine or one step off, SGLang); engine TP > 1 does too
    engine_process: bool = False
    compiled: bool = False  # FSDP2's torch.compile: fused layers keep Megatron's activation count, not eager modules'
    lora_params: int = 0  # LoRA: the adapters' weights, the only ones trained (the base frozen); 0: every weight trains

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @property
    def longest_response(self) -> int:
        return max(self.response_max, self.response_tokens)

    @property
    def tokens(self) -> int:
        return self.samples * self.seq_tokens

    @property
    def sum_sq(self) -> float:
        return self.samples * (self.seq_sq_mean if self.seq_sq_mean is not None else self.seq_tokens ** 2)


@frozen
class Layout:
    """One candidate: the trainer's parallel layout, its micro-batches and recompute, and the generator's."""

    backend: str = "megatron"  # "megatron" | "fsdp2"
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False
    recompute: Recompute = "none"
    train_mb_tokens: int = 8192
    logprob_mb_tokens: int = 16384
    offload: bool = False  # megatron: colocated.offload_trainer_state; fsdp2: dtensor_cfg.cpu_offload
    release: bool = False  # fsdp2: colocated.offload_trainer_state (megatron's is ``offload``)
    colocated: bool = True
    gen_gpus: int = 0  # GPUs of generation's own when not colocated
    gen_tp: int = 1
    gen_memory_fraction: float = 0.0  # filled in by the planner: the engine's share of a GPU (vLLM gpu_memory_utilization)

    @property
    def releases_state(self) -> bool:
        """Whether the trainer's gradients and optimizer state leave the GPU while a colocated engine is awake."""
        return self.release or (self.offload and self.backend == "megatron")

    def train_world(self, world: int) -> int:
        return world if self.colocated else world - self.gen_gpus

    def dp(self, world: int) -> int:
        return self.train_world(world) // (self.tp * self.pp * self.cp)

    def gen_replicas(self, world: int) -> int:
        return (world if self.colocated else self.gen_gpus) // self.gen_tp

    def describe(self, world: int) -> str:
        if self.backend == "fsdp2":
            parts = [f"FSDP={self.dp(world)}"] + ([f"TP={self.tp}"] if self.tp > 1 else []) + (["SP"] if self.sp else [])
        else:
            parts = [f"TP={self.tp}"] + (["SP"] if self.sp else [])
            parts += [f"PP={self.pp}" + (f"x{self.vpp}v" if self.vpp > 1 else "")] if self.pp > 1 else []
            parts += [f"CP={self.cp}"] if self.cp > 1 else []
            parts += [f"EP={self.ep}", f"ETP={self.etp}"] if self.ep > 1 or self.etp != self.tp else []
            parts.append(f"DP={self.dp(world)}")
        return " ".join(parts)

    def describe_generation(self, world: int) -> str:
        where = "colocated" if self.colocated else f"{self.gen_gpus} own GPUs"
        return f"{where}, TP={self.gen_tp} x {self.gen_replicas(world)}"

    def with_(self, **changes) -> Layout:
        return attrs.evolve(self, **changes)

    def with_release(self, release: bool) -> Layout:
        """This layout with the trainer's state released while a colocated engine is awake (or kept): the
        key that says so is ``offload`` on megatron, ``release`` on fsdp2 (whose ``offload`` is cpu_offload)."""
        return self.with_(offload=release) if self.backend == "megatron" else self.with_(release=release)


def micro_batches(work: Workload, budget: int, total_tokens: float) -> tuple[int, int]:
    """(micro-batches, tokens of the fullest) for ``total_tokens`` of ``work``'s sequences: packed, whole sequences
    go into a token budget (one longer than the budget goes alone; sequences of many lengths fill a budget to
    about 97%); unpacked, ``micro_batch_size`` sequences at a time."""
    seq = work.seq_tokens
    if not work.packing:
        return max(1, math.ceil(total_tokens / seq / work.micro_batch_size)), work.micro_batch_size * work.max_seq
    if budget <= seq:
        return max(1, math.ceil(total_tokens / seq)), max(work.max_seq, seq)
    if work.uniform_lengths:
        per_mb = budget // seq
        return max(1, math.ceil(total_tokens / seq / per_mb)), per_mb * seq
    return max(1, math.ceil(total_tokens / (0.97 * budget))), budget
