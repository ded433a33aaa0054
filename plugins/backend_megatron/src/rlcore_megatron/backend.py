"""The Megatron-Core training backend (:class:`rlcore.interfaces.TrainingBackend`).

Every micro-batch is one packed sequence stream (thd layout, ``PackedSeqParams``), padded to a
multiple of TP (times the FP8 GEMM row multiple with FP8). The model's last stage returns hidden
states and the output layer runs only on the rows whose logprobs a loss reads
(:mod:`rlcore_megatron.output`); logprobs come from :func:`rlcore.training.ops.selected_token_logprobs`
(its vocab-parallel form under TP): chunked, in the logits' dtype, so neither full-vocabulary
float32 logits nor, under TP, the full vocabulary is materialized on a rank. A step's
micro-batches go to the device before the schedule runs, with non-blocking copies, and their
metrics stay on the device until the step ends: a blocking copy or a ``.tolist()`` per
micro-batch would make the host wait for the GPU before launching the next micro-batch. Losses are the algorithm's share of the step value
(global normalization by :func:`rlcore.data.packing.step_totals`); Megatron's DDP runs in per-token
mode so data-parallel gradients are summed. Schedules come from ``get_forward_backward_func``
(pipeline-parallel when PP > 1); with ``cuda_graph: micro_batch`` the training micro-batches are
replays of CUDA graphs instead (:mod:`rlcore_megatron.cuda_graph`), and the backend runs what the
schedule would after them (``finalize_model_grads``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from rlcore.config import ConfigError, RunConfig
from rlcore.algorithms.base import merge_metrics
from rlcore.interfaces import Algorithm, NamedTensors, SequenceBatch, StepTotals, WorldInfo
from rlcore.data.packing import MicroBatch, make_micro_batches, step_totals, unpack
from rlcore.training.steps import HostOffloader, check_world, sum_over_ranks, train_in_optimizer_steps
from rlcore.utils import torch_dtype
from rlcore.training.weights import chunked, gather_sequences_to_rank0
from rlcore_megatron import checkpoint, context_parallel, cpu_shims, cuda_graph, kernels, lora, output, parallel
from rlcore_megatron.config import SECTION, MegatronConfig, apply_auto_layout
from rlcore_megatron.convert import iter_hf_weights, load_hf_into_megatron
from rlcore_megatron.model import packed_seq_params


def build_backend(config: RunConfig, section_config: MegatronConfig, world: WorldInfo) -> MegatronBackend:
    """Factory registered as ``megatron`` (torch.distributed is initialized by the caller)."""
    return MegatronBackend(config, section_config, world)


class MegatronBackend:
    """Trains the policy with Megatron-Core; see the module docstring."""

    keeps_reference = True  # a host copy of the initial weights for reference logprobs (a critic has none)

    def __init__(self, config: RunConfig, cfg: MegatronConfig, world: WorldInfo, *, hf_config=None, seed: int | None = None,
                 cuda_graph_capture: bool = True):
        """``hf_config``: build a random-init model from this transformers config instead of
        loading ``policy.model_name`` (benchmarks). ``cuda_graph_capture=False`` with
        ``cuda_graph: micro_batch`` runs the graphs' fixed-shape static-buffer path without capturing
        (CPU tests; on a GPU, to tell a capture problem from a padding one)."""
        self.run, self.cfg, self.world = config, cfg, world
        self.cuda_graph_capture = cuda_graph_capture
        if dist.is_initialized():  # else Megatron's parallel.initialize starts it
            check_world(world, "rlcore-megatron")
        self.on_cpu = world.device == "cpu" or not torch.cuda.is_available()
        if self.on_cpu:
            cpu_shims.install()
        else:
            torch.cuda.set_device(world.local_rank)
        with cpu_shims.active():
            self._build(config, cfg, hf_config, seed)

    def _build(self, config: RunConfig, cfg: MegatronConfig, hf_config, seed: int | None) -> None:
        from transformers import AutoConfig

        self.model_path = config.policy.model_name
        self.hf_config = hf_config if hf_config is not None else AutoConfig.from_pretrained(self.model_path)
        if getattr(self.hf_config, "vision_config", None) is not None:
            raise ConfigError(f"{SECTION}.enabled", f"{self.model_path!r} is a vision-language model "
                              f"({self.hf_config.model_type}); the megatron backend trains text-only models. Use the "
                              "fsdp2 backend (policy.dtensor_cfg.enabled: true, policy.megatron_cfg.enabled: false)")
        cfg = self.cfg = apply_auto_layout(cfg, config, self.hf_config.to_dict(), self.world.world_size, "cpu" if self.on_cpu else "cuda",
                                           report=print if self.world.rank == 0 else lambda _: None)
        self.dp_size = parallel.initialize(cfg, self.hf_config, config, config.train.seed if seed is None else seed)
        self.ranks = parallel.Ranks.current()
        self.kernels = kernels.resolve(cfg, on_cuda=not self.on_cpu, bf16=parallel.params_dtype(cfg, config) == torch.bfloat16)
        if config.policy.lora.enabled:
            self.kernels = lora.kernels_for_lora(self.kernels, cfg)
        if self.world.rank == 0:
            print(f"rlcore-megatron: {self.kernels.describe()}", flush=True)
        self._restore_sms = None  # undoes experimental.gemm_sm_margin's process-wide settings at shutdown
        if cfg.experimental.gemm_sm_margin and not self.on_cpu:
            margin, self._restore_sms = kernels.leave_sms_free(cfg.experimental.gemm_sm_margin)
            if self.world.rank == 0:
                print(f"rlcore-megatron: {margin}", flush=True)
        if cfg.cuda_graph == "micro_batch":
            cuda_graph.check_supported(cfg, config, self.hf_config, self.kernels, on_cpu=self.on_cpu, capture=self.cuda_graph_capture)
        model = self._build_model(cfg, config, load=hf_config is None)
        self.lora = self._apply_lora(model, cfg, config, config.train.seed if seed is None else seed)
        graph_stream = None
        if cfg.cuda_graph == "micro_batch" and self.cuda_graph_capture and not self.on_cpu:
            graph_stream = cuda_graph.capture_stream()
        with torch.cuda.stream(graph_stream) if graph_stream is not None else contextlib.nullcontext():
            # DDP keeps the parameters' AccumulateGrad nodes (its gradient hooks); each remembers the
            # stream it was made on, and a backward captured on another stream would wait on it.
            self.model = parallel.wrap_ddp(model, cfg)
        self.routing = None  # MoE routing replay / mismatch measurement (routing_replay.py)
        if cfg.moe_router_replay != "none" or cfg.moe_routing_metrics:
            from rlcore_megatron.routing_replay import RoutingReplay

            self.routing = RoutingReplay(model, cfg, pad_multiple=self._pad_multiple())
        if cfg.moe_router_replay == "r3" and not config.generation.return_routed_experts:
            raise ConfigError(f"{SECTION}.moe_router_replay", "'r3' replays the experts the generator chose: set "
                              "policy.generation.return_routed_experts: true (the vLLM generator on CUDA)")
        self.optimizer = parallel.build_optimizer(self.model, cfg, config)
        self.scheduler = parallel.build_scheduler(self.optimizer, cfg, config)
        self.graphs = None  # rlcore_megatron.cuda_graph: training micro-batches as CUDA-graph replays
        if cfg.cuda_graph == "micro_batch":
            tokens = -(-config.policy.sequence_packing.train_mb_tokens // self._pad_multiple()) * self._pad_multiple()
            self.graphs = cuda_graph.MicroBatchGraphs(self.model, tokens=tokens, stream=graph_stream,
                                                      log=lambda line: print(line, flush=True) if self.world.rank == 0 else None)
        # The reference policy is the initial one: a host copy of this rank's shard.
        # With LoRA the reference is the base model: the adapters switched off, no copy.
        keep = self.keeps_reference and self.lora is None
        self._reference = {k: v.detach().to("cpu", copy=True) for k, v in self._weights().items()} if keep else {}
        self.step = 0
        self.offloader = HostOffloader()

    def _build_model(self, cfg: MegatronConfig, config: RunConfig, *, load: bool):
        """This rank's model, with the checkpoint's weights when ``load`` (else random init)."""
        model = parallel.build_model(cfg, self.hf_config, config, self.kernels, on_cpu=self.on_cpu, return_hidden_states=True)
        if load:
            load_hf_into_megatron(model, self.model_path, self.hf_config)
        return model

    def _apply_lora(self, model, cfg: MegatronConfig, config: RunConfig, seed: int) -> list | None:
        """``policy.lora``'s adapters attached to ``model`` (base frozen; :mod:`rlcore_megatron.lora`), before DDP wraps it."""
        if not config.policy.lora.enabled:
            return None
        if cfg.cuda_graph == "micro_batch":
            raise ConfigError(f"{SECTION}.cuda_graph", "'micro_batch' graphs are not built for LoRA runs; set it to 'none' "
                              "with policy.lora.enabled")
        return lora.apply(model, config.policy.lora, self.hf_config, seed)

    # ---- helpers -----------------------------------------------------------------------------
    @property
    def module(self):
        return self.model.module

    def _weights(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.module.named_parameters()}

    @property
    def _device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _pad_multiple(self) -> int:
        tp, cp = self.cfg.tensor_model_parallel_size, self.cfg.context_parallel_size
        return (2 * cp * tp if cp > 1 else tp) * self.kernels.token_multiple

    def micro_batches(self, batch: SequenceBatch, max_tokens: int, micro_batch_size: int) -> list[MicroBatch]:
        """This data-parallel rank's packed micro-batches of ``batch`` (padded for TP/CP)."""
        packing = self.run.policy.sequence_packing
        return make_micro_batches(batch, max_tokens, self.ranks.dp, self.dp_size, pad_to_multiple=self._pad_multiple(),
                                  pack=packing.enabled, micro_batch_size=micro_batch_size)

    def _model_inputs(self, mb: MicroBatch):
        """(micro-batch for the loss, input ids [1, T], positions [1, T], PackedSeqParams, logprobs_fn), on the device."""
        device = self._device
        if self.ranks.cp_size > 1:
            lay = context_parallel.layout(mb, self.ranks.cp_size, self.ranks.cp, self._pad_multiple())
            ids, pos, params = context_parallel.inputs(mb, lay, device)
            return mb, ids, pos, params, partial(context_parallel.cp_logprobs, self.module, lay)
        on_device = mb.to(device, non_blocking=True)
        params = packed_seq_params(mb.cu_seqlens, mb.num_tokens, int(mb.max_seqlen), device)
        return (on_device, on_device.input_ids_T[None], on_device.position_ids_T[None], params,
                partial(output.micro_batch_logprobs, self.module, on_device))

    def _forward_step(self, loss_fn, data_iterator, model):
        """Run one micro-batch; ``loss_fn(mb, logprobs_fn, output)`` gets token-aligned logprobs via
        ``logprobs_fn(output)`` (``output``: the last stage's hidden states, see :mod:`rlcore_megatron.output`)."""
        mb, ids, pos, params, logprobs_fn = next(data_iterator)
        if self.routing is not None:
            self.routing.next_micro_batch()
        output = model(ids, pos, None, packed_seq_params=params)
        if self.routing is not None:
            self.routing.after_forward()
        return output, partial(loss_fn, mb, logprobs_fn)

    def _run_schedule(self, mbs: list[MicroBatch], loss_fn, *, forward_only: bool) -> list[dict]:
        # Every micro-batch's inputs are copied up front, while the GPU is still busy with earlier work.
        inputs = [self._model_inputs(mb) for mb in mbs]
        if self.routing is not None:
            self.routing.queue(mbs)
        schedule = get_forward_backward_func()
        return schedule(
            forward_step_func=partial(self._forward_step, loss_fn), data_iterator=iter(inputs), model=[self.model],
            num_microbatches=len(mbs), seq_length=max(mb.num_tokens for mb in mbs), micro_batch_size=1,
            forward_only=forward_only,
        ) or []

    # ---- logprobs ----------------------------------------------------------------------------
    @torch.no_grad()
    @cpu_shims.shimmed
    def logprobs(self, batch: SequenceBatch, *, reference: bool = False) -> list[torch.Tensor] | None:
        if reference:
            with lora.disabled(self.lora) if self.lora is not None else self._swapped(self._reference):
                return self._logprobs(batch)
        if self.routing is None:
            return self._logprobs(batch)
        if not self.routing.from_generator:  # the latest policy logprob pass is the one R2 replays
            with self.routing.recording():
                return self._logprobs(batch)
        if batch.routed_experts:  # R3: old logprobs under the generator's routing, as training will use
            with self.routing.replaying(batch):
                return self._logprobs(batch)
        return self._logprobs(batch)  # sequences the generator did not route (the refit probe's)

    def _logprobs(self, batch: SequenceBatch) -> list[torch.Tensor] | None:
        policy = self.run.policy
        mbs = self.micro_batches(batch, policy.sequence_packing.logprob_mb_tokens, policy.logprob_batch_size)

        def loss_fn(mb, logprobs_fn, output):
            lp_T = logprobs_fn(output)
            return lp_T.sum() * 0.0, torch.tensor(1), {"logprobs": (mb, lp_T)}

        self.module.eval()
        try:
            with self._logprob_precision():
                outputs = self._run_schedule(mbs, loss_fn, forward_only=True)
        finally:
            self.module.train()
        local: dict[int, torch.Tensor] = {}
        if self.ranks.reports:
            for out in outputs:
                mb, lp_T = out["logprobs"]
                local.update(zip(mb.seq_ids, unpack(lp_T.cpu(), mb)))
        del outputs
        self._maybe_empty_cache(2)
        merged = gather_sequences_to_rank0(local, len(batch), "rlcore-megatron")
        return None if merged is None else [values.float() for values in merged]

    @contextlib.contextmanager
    def _logprob_precision(self):
        """FP8 runs with ``fp8_cfg.fp8_logprobs: false`` take the logprob passes in bf16: Megatron
        reads ``config.fp8`` at every forward to decide whether to enter TE's FP8 autocast."""
        tconfig = self.module.config
        if self.kernels.fp8 is None or self.kernels.fp8.fp8_logprobs:
            yield
            return
        saved, tconfig.fp8 = tconfig.fp8, None
        try:
            yield
        finally:
            tconfig.fp8 = saved

    @contextlib.contextmanager
    def _swapped(self, state: dict[str, torch.Tensor]):
        """Temporarily load ``state`` (host copies of this rank's shard) into the model."""
        weights = self._weights()
        saved = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
        with torch.no_grad():
            for k, v in weights.items():
                v.copy_(state[k])
        try:
            yield
        finally:
            with torch.no_grad():
                for k, v in weights.items():
                    v.copy_(saved[k])

    # ---- training ----------------------------------------------------------------------------
    @cpu_shims.shimmed
    def train(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        """One optimizer step per ``policy.train_global_batch_size`` sequences (:mod:`rlcore.training.steps`)."""
        if self.routing is not None:
            if self.routing.from_generator:
                self.routing.use_generator_routing(batch)
            self.routing.require_records(batch)
        return train_in_optimizer_steps(batch, self.run.policy.train_global_batch_size,
                                        lambda part: self._train_step(part, algorithm), "rlcore-megatron")

    def _train_step(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        start = time.perf_counter()
        policy = self.run.policy
        totals = step_totals(batch)
        mbs = self.micro_batches(batch, policy.sequence_packing.train_mb_tokens, policy.train_micro_batch_size)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.graphs is not None:  # no routing here: MoE models are refused with graphs
            outputs = self.graphs.run(mbs, algorithm, totals)
            self.module.config.finalize_model_grads_func([self.model])  # what the schedule does after its last micro-batch
        else:
            with self.routing.training() if self.routing is not None else contextlib.nullcontext():
                outputs = self._run_schedule(mbs, partial(self._loss_fn, algorithm, totals), forward_only=False)
        self._maybe_empty_cache(2)
        metrics = self._reduce_metrics(outputs)
        if self.routing is not None:
            metrics.update(self.routing.step_metrics())
        if not math.isfinite(metrics.get("loss", 0.0)) or not self._grads_finite():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            metrics.update(skipped_nonfinite=1.0, grad_norm=float("nan"), lr=self._lr(), num_micro_batches=float(len(mbs)))
            return metrics
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # fp16 loss-scale overflow
            metrics["skipped_nonfinite"] = 1.0
        else:
            self.scheduler.step(increment=1)
            self.step += 1
        self._maybe_empty_cache(1)
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else 0.0, lr=self._lr(),
                       num_micro_batches=float(len(mbs)), train_seconds=time.perf_counter() - start)
        return metrics

    def _loss_fn(self, algorithm: Algorithm, totals: StepTotals, mb: MicroBatch, logprobs_fn, output):
        logprobs_T = logprobs_fn(output)
        if logprobs_T.device.type != "cpu":  # the algorithm reads mask/fields next to the logprobs
            mb = mb.to(logprobs_T.device, non_blocking=True)
        loss, metrics = algorithm.loss(logprobs_T, mb, totals)
        # 0-d tensor metrics stay on the device (read once per step); floats stay floats.
        metrics = {k: v.detach().double() if torch.is_tensor(v) else v for k, v in metrics.items()}
        metrics["loss"] = loss.detach().double()
        # Under CP every rank holds the whole logprob vector (all-reduced with autograd) and computes
        # the same loss; the all-reduce's backward sums the CP ranks' gradients, hence the division.
        return loss / self.ranks.cp_size, torch.tensor(1, dtype=torch.int), {"metrics": metrics}

    def _reduce_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Sum over micro-batches and data-parallel replicas; every rank gets the result."""
        local: dict[str, float] = {}
        if self.ranks.reports:  # one copy per data-parallel replica (not its TP/PP/CP peers)
            merged: dict[str, object] = {}
            for out in outputs:
                merge_metrics(merged, out["metrics"])
            tensors = [k for k, v in merged.items() if torch.is_tensor(v)]
            values = torch.stack([merged[k] for k in tensors]).tolist() if tensors else []  # one sync
            local = {k: float(v) for k, v in merged.items() if not torch.is_tensor(v)}
            local.update(zip(tensors, values))
        return sum_over_ranks(local)

    def _grads_finite(self) -> bool:
        """Every rank's gradient buffers are finite (one flag all-reduced over the world). Checked on
        each buffer's sum, which is inf/nan when an element is (or past 3e38, which no usable gradient
        reaches), so no full-size temporary: ``isfinite`` of an 8B model's buffer ran out of memory."""
        buffers = self.model.buffers + self.model.expert_parallel_buffers
        sums = torch.stack([b.grad_data.sum().float() for b in buffers]) if buffers else torch.zeros(1, device=self._device)
        flag = torch.isfinite(sums).all().float().reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() == 1.0)

    def _maybe_empty_cache(self, level: int) -> None:
        chosen = self.cfg.empty_unused_memory_level
        if chosen is None:
            chosen = 1 if self.world.placement.colocated else 0
        if chosen >= level and not self.on_cpu:
            torch.cuda.empty_cache()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ---- weights -----------------------------------------------------------------------------
    def export_weights(self, dtype=None, chunk_bytes: int = 1 << 30) -> Iterator[NamedTensors]:
        return cpu_shims.shimmed_iter(self._export_weights(dtype, chunk_bytes))

    def _export_weights(self, dtype, chunk_bytes: int) -> Iterator[NamedTensors]:
        dtype = torch_dtype(dtype)  # a name ("float32", as generators may pass) or a torch.dtype
        named = iter_hf_weights(self.module, self.hf_config)
        if self.lora is not None:  # W + (alpha / r) B A in float32, cast once
            cfg = self.run.policy.lora
            named = lora.merged(named, lora.adapter_tensors(self.module, self.hf_config), cfg.alpha / cfg.rank, dtype)
        elif dtype is not None:
            named = ((n, t.to(dtype)) for n, t in named)
        yield from chunked(named, chunk_bytes)

    @cpu_shims.shimmed
    def export_hf(self, path: str) -> None:
        checkpoint.export_hf(self, path)

    @cpu_shims.shimmed
    def save_checkpoint(self, path: str) -> None:
        checkpoint.save(self, path)

    @cpu_shims.shimmed
    def load_checkpoint(self, path: str) -> None:
        checkpoint.load(self, path)

    # ---- memory ------------------------------------------------------------------------------
    @cpu_shims.shimmed
    def offload(self, *, keep_weights: bool = False) -> None:
        """Release the optimizer state, the main weights that own their storage, the gradient buffers and,
        unless ``keep_weights``, the parameter buffers to host memory (:class:`rlcore.training.steps.HostOffloader`:
        bit for bit, every reference kept; on CPU the storages are released and restored the same way)."""
        if self.offloader.offloaded:
            return
        if self.graphs is not None:  # their memory pool, and buffers that are about to move
            self.graphs.reset()
        buffers = self.model.buffers + self.model.expert_parallel_buffers
        keep = [b.param_data for b in buffers] + self._frozen_weights() if keep_weights else []
        self.offloader.offload(self.state_tensors(), self._device, keep=keep)
        if not self.on_cpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    @cpu_shims.shimmed
    def onload(self) -> None:
        self.offloader.onload()
        if not self.on_cpu:
            torch.cuda.synchronize()

    def state_tensors(self) -> list[torch.Tensor]:
        """The rank's training state: frozen weights, parameter and gradient buffers (the model's other weights
        and gradients are views of them), the optimizer's state and its main weights. AdamW's ``step`` counters stay on
        the host, as torch's AdamW wants them."""
        out = self._frozen_weights()
        for buffer in self.model.buffers + self.model.expert_parallel_buffers:
            out += [buffer.param_data, buffer.grad_data]
        for sub in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            out += [p.data for group in inner.param_groups for p in group["params"]]
            out += [v for state in inner.state.values() for k, v in state.items() if torch.is_tensor(v) and k != "step"]
        return out

    def _frozen_weights(self) -> list[torch.Tensor]:
        """Weights outside DDP's buffers, which hold only what trains: a LoRA run's base, a frozen MoE router."""
        return [p.data for p in self.module.parameters() if not p.requires_grad]

    def shutdown(self) -> None:
        """Drop the model, optimizer and reference copy so their memory is free for what runs next."""
        import gc

        self._reference.clear()
        self.routing = None
        if self.graphs is not None:
            self.graphs.reset()
            self.graphs = None
        self.model = self.optimizer = self.scheduler = None  # type: ignore[assignment]
        gc.collect()
        if not self.on_cpu:
            torch.cuda.empty_cache()
        restore, self._restore_sms = getattr(self, "_restore_sms", None), None
        if restore is not None:
            restore()

