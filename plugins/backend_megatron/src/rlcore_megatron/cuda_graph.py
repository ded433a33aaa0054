"""CUDA graphs for the training micro-batches (``policy.megatron_cfg.cuda_graph: micro_batch``).

Why: at the 1.2B Llama shape a 4-micro-batch step spends about 85% of its span in GPU kernels;
the host launching Transformer Engine's modules (about 1,900 kernels a step) keeps the GPU idle
the rest. A graph replays a whole
micro-batch's kernels from one launch.

What one graph holds, per shape bucket: the model forward on the packed thd micro-batch, the
output layer and logprobs on the selected rows, ``algorithm.loss`` and the backward, which adds
into Megatron's fp32 main-grad buffers in place (DDP's backward hooks, and TE's fused weight-gradient
accumulation). Outside it, in the backend: zeroing the grad buffers, ``finalize_model_grads`` (the
data-parallel reduce), the non-finite check and the optimizer step.

Fixed shapes. Every micro-batch is laid out in one :class:`StaticInputs` of its :class:`Bucket`:
``T`` tokens (``train_mb_tokens`` rounded up to the backend's pad multiple), the real sequences,
then one padding segment to ``T`` and zero-length segments up to a power-of-two segment count;
per-sequence fields padded with zero-weight dummy sequences that no token points at; the logprob
rows padded to a multiple of ``T / 8`` with rows whose target is one extra token slot past the
stream, dropped before the loss sees it (so they get no gradient). ``max_seqlen`` is ``T + 1``
for every micro-batch (FlashAttention's and TE's fused RoPE bound; one more than ``T`` because
Megatron's unfused thd RoPE reads a frequency table exactly ``T`` long as positions running
across sequences). The step's :class:`~rlcore.interfaces.StepTotals` become 0-d device tensors.
Inputs are copied into the static buffers before each replay; outputs (loss, metrics) are
cloned from the graph's static outputs after it.

Capture: the first micro-batch of a bucket runs eagerly on a side stream (torch's warm-up; it is
that micro-batch's real computation, so its gradients and metrics count, and lazily built state
such as compiled kernels, workspaces and RoPE tables exists before capture), then the same call is
captured (capture launches nothing); later micro-batches of the bucket replay it. All graphs share
one memory pool and replay one at a time on one stream, in any order: a graph may reuse blocks
another freed, which is safe because outputs are cloned right after their own replay. A loss
must not read the static micro-batch's host-side fields (``cu_seqlens``, ``seq_ids``,
``num_padding``): a replay would keep what they held at capture (:class:`rlcore.interfaces.CapturableLoss`). Each capture is logged with the bucket,
its seconds and the memory the pool grew by. Graphs are dropped and captured again when a
parameter or gradient buffer moved (offload, checkpoint load) or another algorithm trains.

Why not Megatron-Core's own CUDA graphs: its Transformer Engine path (``cuda_graph_impl:
transformer_engine``, per-layer ``make_graphed_callables``) refuses ``packed_seq_params``; its
local ``CudaGraphManager`` records per-layer graphs keyed on exact input shapes (every packing is
new); ``FullCudaGraphWrapper`` captures a whole ``forward_backward_func`` call, which needs a fixed
number of micro-batches and its own static data loader. What is used from them: a plain
``torch.cuda.graph`` capture in ``thread_local`` error mode (as ``FullCudaGraphWrapper``), and
Megatron's DDP hooks, which accumulate into ``main_grad`` under a torch capture (they return early
only under Megatron's own capture flag, which is not set here). The graph-safe RNG trackers
(``te_rng_tracker``, ``use_cudagraphable_rng``) are not needed: the models here have no dropout
(checked before capture), so nothing in a graph draws random numbers, and the default trackers
keep the checkpointed RNG state format. FP8 is refused (config.py says what was measured).

CPU (tests): ``capture=False`` runs the same static buffers through the same function directly.
"""

from __future__ import annotations

import time

import attrs
import torch

from rlcore.algorithms.base import token_advantages
from rlcore.config import ConfigError
from rlcore.interfaces import CapturableLoss, StepTotals
from rlcore.data.packing import MicroBatch
from rlcore_megatron import output
from rlcore_megatron.config import SECTION, MegatronConfig
from rlcore_megatron.model import packed_seq_params

KEY = f"{SECTION}.cuda_graph"
MIN_SEGMENTS = 8  # cu_seqlens buckets: powers of two from here (zero-length segments are nearly free)
ROW_BUCKETS = 8  # logprob rows round up to a multiple of T / ROW_BUCKETS


def check_supported(cfg: MegatronConfig, run, hf_config, kernels, *, on_cpu: bool, capture: bool) -> None:
    """The refusals that need the model and device (config.py checks the rest): ConfigErrors naming the key."""
    if on_cpu and capture:
        raise ConfigError(KEY, "needs CUDA: there is no graph to capture on the CPU (tests run the same fixed-shape "
                          "path without capture: MegatronBackend(..., cuda_graph_capture=False))")
    if getattr(hf_config, "num_experts", None):
        raise ConfigError(KEY, "mixture-of-experts models are not supported: the token dispatch sizes the expert "
                          "inputs per micro-batch on the host")
    if not run.policy.sequence_packing.enabled:
        raise ConfigError(KEY, "needs policy.sequence_packing.enabled=true: graphs are captured for micro-batches "
                          "padded to the token budget policy.sequence_packing.train_mb_tokens")
    if not on_cpu and not kernels.rope_fusion:
        raise ConfigError(KEY, "needs the fused RoPE of Transformer Engine's layers (apply_rope_fusion): Megatron's "
                          "unfused RoPE on packed sequences reads the sequence lengths on the host")


def check_algorithm(algorithm) -> None:
    if not (isinstance(algorithm, CapturableLoss) and algorithm.capturable_loss):
        raise ConfigError(KEY, f"algorithm {getattr(algorithm, 'name', type(algorithm).__name__)!r} does not declare a "
                          "capturable loss (rlcore.interfaces.CapturableLoss: no host reads of tensor values, no "
                          "data-dependent shapes); use cuda_graph=none for it")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@attrs.frozen
class Bucket:
    """The shapes one graph is captured for."""

    segments: int  # cu_seqlens entries - 1: real sequences, the padding segment, empty segments
    rows: int  # logprob rows, padded
    fields: tuple  # (("token"|"seq", name, dtype, trailing shape), ...): the loss's inputs besides the token stream

    @property
    def seqs(self) -> int:
        return self.segments - 1


def bucket_for(mb: MicroBatch, tokens: int) -> Bucket:
    segments = max(MIN_SEGMENTS, 1 << mb.num_seqs.bit_length())  # n + 1 segments at least
    quantum = max(1, tokens // ROW_BUCKETS)
    rows = 0 if mb.logprob_rows_R is None else int(mb.logprob_rows_R.numel())
    fields = tuple(sorted([("token", k, v.dtype, ()) for k, v in mb.token_fields.items()]
                          + [("seq", k, v.dtype, tuple(v.shape[1:])) for k, v in mb.seq_fields.items()], key=str))
    return Bucket(segments=segments, rows=max(quantum, min(_round_up(rows, quantum), tokens)), fields=fields)


class StaticInputs:
    """Device buffers of one bucket that every replay reads, and the MicroBatch / PackedSeqParams /
    StepTotals views the model and the loss see."""

    def __init__(self, bucket: Bucket, tokens: int, device: torch.device):
        self.bucket, self.tokens = bucket, tokens

        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.ids_T1 = zeros(tokens + 1, dtype=torch.int64)  # + the slot padded logprob rows predict
        self.pos_T = zeros(tokens, dtype=torch.int64)
        self.seq_index_T = zeros(tokens, dtype=torch.int64)
        self.mask_T = zeros(tokens)
        self.rows_R = zeros(bucket.rows, dtype=torch.int64)
        self.totals_2 = zeros(2, dtype=torch.float64)
        self.cu_host = torch.zeros(bucket.segments + 1, dtype=torch.int32)
        self.token_fields = {n: zeros(tokens, dtype=d) for kind, n, d, _ in bucket.fields if kind == "token"}
        self.seq_fields = {n: zeros(bucket.seqs, *shape, dtype=d) for kind, n, d, shape in bucket.fields if kind == "seq"}
        self.params = packed_seq_params(torch.full((bucket.segments + 1,), tokens, dtype=torch.int32), tokens, tokens + 1, device)
        self.params.max_seqlen_q = self.params.max_seqlen_kv = tokens + 1  # see the module docstring
        self.mb = MicroBatch(
            input_ids_T=self.ids_T1[:tokens], position_ids_T=self.pos_T, cu_seqlens=self.cu_host, max_seqlen=tokens + 1,
            seq_ids=[-1] * bucket.seqs, seq_index_T=self.seq_index_T, loss_mask_T=self.mask_T, token_fields=self.token_fields,
            seq_fields=self.seq_fields, num_padding=0, logprob_rows_R=self.rows_R)
        self.totals = StepTotals(num_valid_tokens=self.totals_2[0], num_valid_seqs=self.totals_2[1])

    def load(self, mb: MicroBatch, totals: StepTotals) -> None:
        """Copy ``mb`` (host tensors) into the buffers, padded as the module docstring says."""
        T, n, used = self.tokens, mb.num_seqs, mb.num_tokens - mb.num_padding
        if mb.num_tokens > T:
            raise ValueError(f"rlcore-megatron: a micro-batch of {mb.num_tokens} tokens exceeds the CUDA-graph token "
                             f"budget {T} (policy.sequence_packing.train_mb_tokens rounded to the pad multiple)")
        pad = T - mb.num_tokens

        def padded(x, value=0):
            return torch.nn.functional.pad(x, (0, pad), value=value) if pad else x

        self.ids_T1[:T].copy_(padded(mb.input_ids_T), non_blocking=True)
        # the padding segment's positions run 0, 1, ... as in the packed layout
        self.pos_T.copy_(torch.cat([mb.position_ids_T[:used], torch.arange(T - used, dtype=torch.int64)]), non_blocking=True)
        self.seq_index_T.copy_(padded(mb.seq_index_T, -1), non_blocking=True)
        self.mask_T.copy_(padded(mb.loss_mask_T.float()), non_blocking=True)
        for name, buf in self.token_fields.items():
            buf.copy_(padded(mb.token_fields[name]), non_blocking=True)
        for name, buf in self.seq_fields.items():
            values = mb.seq_fields[name]  # dummy sequences: zeros (no token points at them)
            buf.copy_(torch.cat([values, values.new_zeros((self.bucket.seqs - n, *values.shape[1:]))]), non_blocking=True)
        rows = mb.logprob_rows_R if mb.logprob_rows_R is not None else torch.zeros(0, dtype=torch.int64)
        self.rows_R.copy_(torch.nn.functional.pad(rows, (0, self.bucket.rows - rows.numel()), value=T - 1), non_blocking=True)
        cu = torch.full((self.bucket.segments + 1,), T, dtype=torch.int32)
        cu[: n + 1] = mb.cu_seqlens
        self.cu_host.copy_(cu)
        self.params.cu_seqlens_q.copy_(cu, non_blocking=True)  # cu_seqlens_kv is the same tensor
        self.params.host_bounds = tuple(cu.tolist())
        self.totals_2.copy_(torch.tensor([float(totals.num_valid_tokens), float(totals.num_valid_seqs)], dtype=torch.float64),
                            non_blocking=True)


def capture_stream() -> torch.cuda.Stream:
    """The side stream that warm-up and capture run on. The backend wraps the model in Megatron's DDP
    under it: DDP holds the parameters' AccumulateGrad nodes, which remember the stream they were made
    on, and a backward captured on a different stream then waits on that one, which capture forbids
    ("operation would make the legacy stream depend on a capturing blocking stream" with DDP built
    on the default stream; torch's CUDA-graph notes ask the same for its own DDP)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


class MicroBatchGraphs:
    """Runs a step's training micro-batches through one captured graph per :class:`Bucket`."""

    def __init__(self, model, *, tokens: int, log, stream: torch.cuda.Stream | None = None):
        """``stream``: the :func:`capture_stream` DDP was built under, kept for the backend's lifetime
        (across :meth:`reset`); None runs the same fixed-shape path without capture (CPU, tests)."""
        self.model, self.tokens, self.log, self.stream = model, tokens, log, stream
        self.capture = stream is not None
        self.device = next(model.module.parameters()).device
        self._reset_state()

    def _reset_state(self) -> None:
        self.static: dict[Bucket, StaticInputs] = {}
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Bucket, dict[str, torch.Tensor]] = {}
        self.lengths_seen: dict[Bucket, set[int]] = {}  # real token counts each bucket served (tests, logs)
        self.replays = 0
        self.pool_bytes = 0  # reserved-memory growth over this pool's captures
        self.algorithm = None
        self.fingerprint = None
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def reset(self) -> None:
        """Drop every graph and its memory (the next step captures again)."""
        had = bool(self.graphs)
        self._reset_state()
        if had:
            torch.cuda.empty_cache()

    def _storage_fingerprint(self) -> tuple:
        module = self.model.module
        return tuple((p.data_ptr(), getattr(p, "main_grad", p).data_ptr()) for p in module.parameters())

    def run(self, mbs: list[MicroBatch], algorithm, totals: StepTotals) -> list[dict]:
        """Forward + loss + backward of every micro-batch; one ``{"metrics": {...}}`` per micro-batch
        (the schedule's outputs), metrics as 0-d float64 tensors."""
        check_algorithm(algorithm)
        key = (algorithm, algorithm.uses_old_logprobs, algorithm.uses_reference, algorithm.loss_level)
        fingerprint = self._storage_fingerprint()
        if self.algorithm != key or self.fingerprint != fingerprint:
            self.reset()
            self.algorithm, self.fingerprint = key, fingerprint
        outputs = []
        for mb in mbs:
            if "advantages" in mb.token_fields or "advantages" in mb.seq_fields:
                token_advantages(algorithm.name, mb)  # its finiteness check, which the loss skips while capturing
            bucket = bucket_for(mb, self.tokens)
            static = self.static.get(bucket)
            if static is None:
                static = self.static[bucket] = StaticInputs(bucket, self.tokens, self.device)
            static.load(mb, totals)
            self.lengths_seen.setdefault(bucket, set()).add(mb.num_tokens - mb.num_padding)
            outputs.append({"metrics": self._run_one(bucket, static, algorithm)})
        return outputs

    def _run_one(self, bucket: Bucket, static: StaticInputs, algorithm) -> dict[str, torch.Tensor]:
        if not self.capture:
            return self._forward_backward(static, algorithm)
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._warm_up_and_capture(bucket, static, algorithm)
        graph.replay()
        self.replays += 1
        return {k: v.clone() for k, v in self.outputs[bucket].items()}

    def _forward_backward(self, static: StaticInputs, algorithm) -> dict[str, torch.Tensor]:
        """The captured function: reads only ``static``'s buffers and the model's weights."""
        hidden = self.model(static.ids_T1[None, : self.tokens], static.pos_T[None], None, packed_seq_params=static.params)
        logprobs_T = output.selected_rows_logprobs(self.model.module, hidden, static.ids_T1, static.rows_R)[: self.tokens]
        loss, metrics = algorithm.loss(logprobs_T, static.mb, static.totals)
        floats = sorted(k for k, v in metrics.items() if not torch.is_tensor(v))
        if floats:
            raise ValueError(f"rlcore-megatron: {KEY}: algorithm {algorithm.name!r} returned Python-number metrics {floats}, "
                             "which a graph would freeze at their captured values; return 0-d tensors")
        out = {k: v.detach().double() for k, v in metrics.items()}
        out["loss"] = loss.detach().double()
        loss.backward()
        return out

    def _warm_up_and_capture(self, bucket: Bucket, static: StaticInputs, algorithm) -> dict[str, torch.Tensor]:
        """Torch's recipe: run once on a side stream (this micro-batch's real work), then capture."""
        tconfig = self.model.module.config
        if tconfig.hidden_dropout or tconfig.attention_dropout:
            raise RuntimeError(f"rlcore-megatron: {KEY} assumes no dropout (nothing in a graph draws random numbers); "
                               f"hidden_dropout={tconfig.hidden_dropout}, attention_dropout={tconfig.attention_dropout}")
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            eager = self._forward_backward(static, algorithm)
        torch.cuda.current_stream().wait_stream(self.stream)
        eager = {k: v.clone() for k, v in eager.items()}  # on the current stream, where the step reads them
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # torch.cuda.graph empties the cache too: measure the pool's growth alone
        reserved, start = torch.cuda.memory_reserved(), time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                self.outputs[bucket] = self._forward_backward(static, algorithm)
        except RuntimeError as err:
            raise RuntimeError(
                f"rlcore-megatron: capturing the training micro-batch for {KEY}=micro_batch failed ({bucket.segments} "
                f"segments, {bucket.rows} logprob rows, {self.tokens} tokens): {err}. Host reads of device values "
                "(.item(), .tolist(), nonzero, boolean masks) cannot be captured; set cuda_graph: none, or build the "
                "backend with cuda_graph_capture=False to run the same fixed-shape path without capture") from err
        self.graphs[bucket] = graph
        torch.cuda.synchronize()
        grown = max(torch.cuda.memory_reserved() - reserved, 0)
        self.pool_bytes += grown
        self.log(f"rlcore-megatron: captured a CUDA graph of the training micro-batch ({self.tokens} tokens, "
                 f"{bucket.segments} segments, {bucket.rows} logprob rows) in {time.perf_counter() - start:.2f} s; "
                 f"the pool grew {grown / 2**30:.2f} GiB to {self.pool_bytes / 2**30:.2f} GiB for {len(self.graphs)} "
                 "graph(s) (segments x rows): " + ", ".join(f"{b.segments}x{b.rows}" for b in self.graphs))
        return eager
