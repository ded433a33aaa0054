"""The ``fsdp2`` training backend: a Hugging Face causal LM under FSDP2 (+ DTensor TP/SP).

Each trainer rank builds one :class:`FSDP2Backend`; every rank gets the same calls with the same
:class:`~rlcore.interfaces.SequenceBatch` and takes its data-parallel share of it through
:func:`rlcore.data.packing.make_micro_batches`. Micro-batches are packed rows whose attention stays
inside each sequence (:mod:`rlcore_fsdp2.attention`); logprobs come from
:func:`rlcore.training.ops.token_logprobs` (chunked, never full-vocab float32 for the whole row).

Training follows rlcore's global normalization: the algorithm's loss of a micro-batch is already
its share of the step loss (divided by :func:`rlcore.data.packing.step_totals` of the whole optimizer
step), so gradients are accumulated over micro-batches and SUMMED over data-parallel ranks.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlcore.algorithms.base import merge_metrics
from rlcore.config.schema import RunConfig
from rlcore.config.structure import ConfigError
from rlcore.interfaces import Algorithm, SequenceBatch, WorldInfo
from rlcore.data.multimodal import (ImageInputs, encoding_shared_images_once, is_vision_language, mrope_positions,
                               uses_multimodal_rope, vision_modules)
from rlcore.training.ops import selected_token_logprobs, token_logprobs
from rlcore.data.packing import MicroBatch, make_micro_batches, step_totals, unpack
from rlcore_fsdp2 import accumulators, attention, checkpoint, lora, one_rank
from rlcore_fsdp2.config import DTensorConfig, apply_auto_layout
from rlcore_fsdp2.optim import ShardLocalAdamW
from rlcore_fsdp2.parallel_dims import ParallelDims
from rlcore_fsdp2.parallelize import defer_grad_sync, hf_name, parallelize
from rlcore.training.schedule import lr_lambda
from rlcore.training.steps import HostOffloader, check_world, sum_over_ranks, train_in_optimizer_steps
from rlcore.utils import torch_dtype
from rlcore.training.weights import chunked, gather_sequences_to_rank0, write_hf_checkpoint
from rlcore_fsdp2.weights import ReferencePolicy, gather_full, iter_hf_tensors, local, state_tensors

log = logging.getLogger(__name__)


def build_backend(config: RunConfig, section_config: DTensorConfig | None, world: WorldInfo) -> FSDP2Backend:
    """Factory registered as ``fsdp2`` (see :mod:`rlcore_fsdp2.plugin`)."""
    return FSDP2Backend(config, section_config or DTensorConfig(), world)


class FSDP2Backend:
    """Implements :class:`rlcore.interfaces.TrainingBackend`."""

    keeps_reference = True  # a host copy of the initial weights for reference logprobs (a critic has none)

    def __init__(self, config: RunConfig, cfg: DTensorConfig, world: WorldInfo, *, hf_config: Any = None, seed: int | None = None):
        """``hf_config``: build a random-init model from this transformers config instead of
        loading ``policy.model_name`` (benchmarks)."""
        check_world(world, "fsdp2 backend")
        self.config, self.cfg, self.world, self.policy = config, cfg, world, config.policy
        self.device = self._init_device(world)
        self.hf_config = self._load_hf_config(hf_config)
        cfg = self.cfg = apply_auto_layout(cfg, config, self.hf_config.to_dict(), world.world_size, self.device.type,
                                           report=print if world.rank == 0 else lambda _: None)
        self.dims = ParallelDims.from_config(cfg.tensor_parallel_size, cfg.context_parallel_size, world.world_size)
        if self.policy.precision == "float16":
            raise ConfigError("policy.precision", "float16 is not supported by the fsdp2 backend (it has no loss "
                              "scaling, so small gradients would underflow); use bfloat16")
        self.compute_dtype = torch_dtype(self.policy.precision)
        # Master weights and gradient reduction stay in fp32 (fp64 for float64 runs).
        self.master_dtype = torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        self.dims.check_model(self.hf_config)
        self.vision = is_vision_language(self.hf_config)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_rank = self.mesh["dp_shard"].get_local_rank()
        self.model = self._build_model(hf_config is not None, seed if seed is not None else config.train.seed)
        parallelize(self.model, self.dims, self.mesh, cfg, param_dtype=self.compute_dtype,
                    reduce_dtype=self.master_dtype, device_type=self.device.type)
        self.params = list(self.model.parameters())
        self.fsdp_modules = _fsdp_modules(self.model)  # the root (and each decoder layer, see apply_fsdp)
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.config))
        self.reference = ReferencePolicy(self.params) if self.keeps_reference else None
        self.offloader = HostOffloader()
        self.step = 0
        self._empty_cache_after_train = self.device.type == "cuda" and _empty_cache_after_train(world, cfg)
        # FSDP2's one-rank copy-in and accumulation, cheaper (process-wide until shutdown)
        self._fast_paths = (cfg.experimental.one_rank_fast_paths and self.mesh["dp_shard"].size() == 1
                            and one_rank.install())
        self._grad_sync: bool | None = None  # last value given to set_requires_gradient_sync (None: never set)

    # ---- construction ----------------------------------------------------------------------
    @staticmethod
    def _init_device(world: WorldInfo) -> torch.device:
        if world.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("fsdp2 backend: WorldInfo.device is 'cuda' but CUDA is not available")
            torch.cuda.set_device(world.local_rank)
            return torch.device("cuda", world.local_rank)
        return torch.device("cpu")

    def _load_hf_config(self, hf_config: Any) -> Any:
        from transformers import AutoConfig

        if hf_config is not None:
            return hf_config
        path = Path(self.policy.model_name)
        if path.is_dir() and not (path / "config.json").exists():
            raise FileNotFoundError(f"policy.model_name: {str(path)!r} is not a Hugging Face checkpoint "
                                    "directory (no config.json)")
        return AutoConfig.from_pretrained(self.policy.model_name)  # a directory, or a hub id as transformers takes it

    def _build_model(self, random_init: bool, seed: int) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        impl = attention.register()
        loader = AutoModelForCausalLM
        if self.vision:
            # Packed causal attention in the decoder; the vision tower's own (bidirectional, per image) SDPA.
            loader, impl = AutoModelForImageTextToText, {"text_config": impl, "vision_config": "sdpa", "": impl}
        if random_init:
            torch.manual_seed(seed)
            with torch.device(self.device):
                model = loader.from_config(self.hf_config, dtype=self.master_dtype, attn_implementation=impl)
        else:
            model = loader.from_pretrained(self.policy.model_name, dtype=self.master_dtype, attn_implementation=impl)
            model.to(self.device)
        model.config.use_cache = False
        if self.vision and self.cfg.freeze_vision_tower:
            for module in vision_modules(model):
                module.requires_grad_(False)
        if self.policy.lora.enabled:
            if self.dims.tp > 1:
                raise ConfigError("policy.lora.enabled", "LoRA on the fsdp2 backend needs tensor_parallel_size 1 (the "
                                  "tensor-parallel plan does not cover the adapters' layers)")
            lora.apply_lora(model, self.policy.lora)
        return model

    def _build_optimizer(self) -> torch.optim.Optimizer:
        opt = self.policy.optimizer
        # Fused AdamW (one kernel over all local shards; torch has it for CUDA and CPU), whose
        # clipping and non-finite skip run on the device (see _update). With CPU offload the
        # gradients' norm is on the GPU and the update on the host: torch's default loop there.
        return ShardLocalAdamW(self.params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                               weight_decay=opt.weight_decay, fused=not self.cfg.cpu_offload)

    # ---- forward ---------------------------------------------------------------------------
    @property
    def _pad_multiple(self) -> int:
        return self.dims.tp if self.cfg.sequence_parallel else 1

    def _micro_batches(self, batch: SequenceBatch, *, train: bool) -> list[MicroBatch]:
        packing = self.policy.sequence_packing
        return make_micro_batches(
            batch, packing.train_mb_tokens if train else packing.logprob_mb_tokens, self.dp_rank, self.dims.dp_shard,
            pad_to_multiple=self._pad_multiple, pack=packing.enabled,
            micro_batch_size=self.policy.train_micro_batch_size if train else self.policy.logprob_batch_size)

    def _forward_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Token-aligned logprobs [T] of a (device) micro-batch; float32 (float64 for float64 runs).

        Only the tokens the loss reads (``mb.logprob_rows_R``: loss-masked ones) get a value, the
        others 0: the LM head runs on those rows alone (``logits_to_keep``), never on prompt rows.
        Under sequence or context parallelism each rank holds a slice of the rows, so the head
        runs on all of them there (values the same)."""
        cu, max_len = attention.attention_cu_seqlens(mb.cu_seqlens, mb.num_tokens, self.device)
        rows_R = mb.logprob_rows_R
        select = rows_R is not None and rows_R.numel() > 0 and not self.cfg.sequence_parallel and self.dims.cp == 1
        inputs = self._vision_inputs(mb) if self.vision else {"position_ids": mb.position_ids_T[None]}
        with encoding_shared_images_once(self.model, mb.images, self.device):
            out = self.model(input_ids=mb.input_ids_T[None], use_cache=False, **inputs,
                             cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len,
                             logits_to_keep=rows_R if select else 0)
        # squeeze, not [0]: indexing's backward would fill a zero [T, V] tensor
        if select:
            return selected_token_logprobs(out.logits.squeeze(0), mb.input_ids_T, rows_R,
                                           chunk_tokens=self.cfg.logprob_chunk_tokens)
        return token_logprobs(out.logits.squeeze(0), mb.input_ids_T, mb.cu_seqlens, chunk_tokens=self.cfg.logprob_chunk_tokens)

    def _vision_inputs(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """A vision-language model's inputs: the micro-batch's pixels and positions: for Qwen-VL [4, 1, T],
        the packed text positions (restarting per sequence), then each sequence's multimodal rotary
        positions; for the others (LLaVA) the packed text positions [1, T]."""
        ids_T, cu = mb.input_ids_T, mb.cu_seqlens.tolist()
        token = int(self.hf_config.image_token_id)
        per_seq = mb.images if mb.images is not None else [None] * mb.num_seqs
        images = ImageInputs.concat(per_seq)
        pixels = {} if images is None else images.model_inputs(self.compute_dtype)
        if not uses_multimodal_rope(self.model):
            return {"position_ids": mb.position_ids_T[None], **pixels}
        rope_3T = torch.cat([mrope_positions(self.model, ids_T[a:b], images, token)
                             for a, b, images in zip(cu[:-1], cu[1:], per_seq)]
                            + [torch.arange(mb.num_padding, device=ids_T.device).expand(3, -1)], dim=1)
        return {"position_ids": torch.cat([mb.position_ids_T[None], rope_3T])[:, None], **pixels}

    # ---- TrainingBackend -------------------------------------------------------------------
    def logprobs(self, batch: SequenceBatch, *, reference: bool = False) -> list[torch.Tensor] | None:
        if reference:
            with self.reference.swapped_in():
                return self._logprobs(batch)
        return self._logprobs(batch)

    @torch.no_grad()
    def _logprobs(self, batch: SequenceBatch) -> list[torch.Tensor] | None:
        self.model.eval()
        mine: dict[int, torch.Tensor] = {}
        for mb in self._micro_batches(batch, train=False):
            logprobs_T = self._forward_logprobs(mb.to(self.device, non_blocking=True)).float().cpu()
            for seq_id, values in zip(mb.seq_ids, unpack(logprobs_T, mb)):
                mine[seq_id] = values.clone()
        # Without reshard_after_forward the gathered params outlive a no-grad forward (no backward
        # frees them): free them, so reference swaps, refits and offloading see only the shards.
        self._reshard()
        return gather_sequences_to_rank0(mine, len(batch), "fsdp2 backend")

    def train(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        """One optimizer step per ``policy.train_global_batch_size`` sequences (all of them when
        unset); returns the mean over optimizer steps of each step's summed metrics, plus
        ``lr`` (last), ``num_micro_batches`` (per rank, all steps) and ``num_optimizer_steps``."""
        self.model.train()
        out = train_in_optimizer_steps(batch, self.policy.train_global_batch_size,
                                       lambda part: self._train_step(part, algorithm), "fsdp2 backend")
        if self._empty_cache_after_train:
            # Return the allocator's cached activation blocks: a colocated engine wakes up next and
            # needs them (at 8B the cache can hold most of the GPU, and the engine's wake-up then
            # runs out of memory). Not by default without colocation: re-allocating them next step
            # costs host time (cudaMalloc/cudaFree).
            torch.cuda.empty_cache()
        return out

    def _train_step(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        totals = step_totals(batch)
        micro_batches = self._micro_batches(batch, train=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        metrics: dict[str, Any] = {}
        defer = defer_grad_sync(self.cfg, self.dims)
        if defer and self.cfg.experimental.preallocate_grad_accumulators:
            accumulators.preallocate(self.fsdp_modules)
        for index, mb in enumerate(micro_batches):
            if defer:  # reduce (and reshard) once, after the last micro-batch's backward
                self._set_grad_sync(index == len(micro_batches) - 1)
            mb = mb.to(self.device, non_blocking=True)
            logprobs_T = self._forward_logprobs(mb)
            if mb.num_seqs == 0:
                # Padding-only micro-batch: a zero loss that still runs backward, so the FSDP
                # collectives of every rank stay in lockstep.
                loss, mb_metrics = logprobs_T.sum() * 0.0, {}
            else:
                loss, mb_metrics = algorithm.loss(logprobs_T, mb, totals)
            loss.backward()
            loss_sum += loss.detach().to(torch.float64)
            # tensors stay on the device: no sync per micro-batch
            merge_metrics(metrics, {k: v.detach() if torch.is_tensor(v) else v for k, v in mb_metrics.items()})
        return self._update(loss_sum, metrics, len(micro_batches))

    def _update(self, loss_sum: torch.Tensor, metrics: dict[str, Any], num_micro_batches: int) -> dict[str, float]:
        """Clip, step (or skip a non-finite step), and read the step's values on the host.

        With the fused optimizer the clip factor and the skip decision stay on the device (the
        kernel's ``grad_scale`` / ``found_inf``): the host launches the update while the GPU is
        still in the backward pass and waits once, for the values it reports. Otherwise (CPU
        offload) it reads the norm first and clips and steps on the host."""
        dp_group = self.mesh["dp_shard"].get_group()
        if self.dims.dp_shard > 1:
            dist.all_reduce(loss_sum, group=dp_group)
        grad_sq = self._grad_norm_squared()
        max_norm = self.policy.max_grad_norm
        clip = max_norm is not None and max_norm > 0
        on_device = bool(self.optimizer.defaults.get("fused"))
        if on_device:
            nonfinite = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_sq))
            grad_scale = ((grad_sq.sqrt() + 1e-6) / max_norm).clamp(min=1.0).float() if clip else None
            self.optimizer.step(grad_scale=grad_scale, found_inf=nonfinite.float())
        on_device_keys = [key for key, value in metrics.items() if torch.is_tensor(value)]
        values = torch.stack([metrics[key].to(self.device, torch.float64) for key in on_device_keys]
                             + [loss_sum, grad_sq.sqrt()]).tolist()  # the step's one device sync
        *metric_values, loss_total, grad_norm = values
        metrics = {**{k: float(v) for k, v in metrics.items() if not torch.is_tensor(v)}, **dict(zip(on_device_keys, metric_values))}
        if self.dims.dp_shard > 1:  # TP peers hold the same values: summed over data-parallel ranks only
            metrics = sum_over_ranks(metrics, dp_group)
        result = {**metrics, "loss": loss_total, "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
                  "num_micro_batches": float(num_micro_batches)}
        finite = math.isfinite(loss_total) and math.isfinite(grad_norm)
        if finite and not on_device:
            coef = min(1.0, max_norm / (grad_norm + 1e-6)) if clip else 1.0
            if coef < 1.0:
                self._scale_grads(coef)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not finite:
            log.warning("fsdp2 backend: non-finite loss %s / grad norm %s; skipping the update", loss_total, grad_norm)
            return {**result, "skipped_nonfinite": 1.0}
        self.scheduler.step()
        self.step += 1
        return result

    def _set_grad_sync(self, sync: bool) -> None:
        """FSDP2's gradient sync and reshard-after-backward flags, set only when they change and
        only on the FSDP modules: the recursive setters walk every submodule (~4 ms of host time
        per call at 16 layers)."""
        if self._grad_sync != sync:
            for module in self.fsdp_modules:
                module.set_requires_gradient_sync(sync, recurse=False)
                module.set_reshard_after_backward(sync, recurse=False)
            self._grad_sync = sync

    @torch.no_grad()
    def _grad_norm_squared(self) -> torch.Tensor:
        """Squared global L2 norm of all gradients: a float64 device tensor, no host sync.

        Local shards' squared norms are summed per (mesh, sharded dims) and all-reduced over the
        sharded mesh dims only (a replicated dim would count a shard twice). Params may live on
        different meshes (TP'd layers on (dp, tp), replicated MoE experts on dp) and, with CPU
        offload, on the host: this works for all of them where DTensor's own norm would not."""
        groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
        for p in self.params:
            g = p.grad
            if isinstance(g, DTensor):
                sharded = tuple(i for i, placement in enumerate(g.placements) if placement.is_shard())
                groups[(g.device_mesh, sharded)].append(g._local_tensor)
            elif g is not None:
                groups[(None, ())].append(g)
        total_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for (mesh, sharded), tensors in groups.items():
            norms = torch._foreach_norm(tensors)
            sq = torch.stack(norms).to(self.device, torch.float64).square().sum()
            for dim in sharded:
                dist.all_reduce(sq, group=mesh.get_group(dim))
            total_sq += sq
        return total_sq

    @torch.no_grad()
    def _scale_grads(self, coef: float) -> None:
        """Multiply all gradients by ``coef``: one foreach kernel per device over the local shards
        (a mul_ per DTensor gradient goes through DTensor dispatch, ~15 ms of host time a step at
        1.2B)."""
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for p in self.params:
            if p.grad is not None:
                shard = local(p.grad)
                by_device[shard.device].append(shard)
        for tensors in by_device.values():
            torch._foreach_mul_(tensors, coef)

    def export_weights(self, dtype: Any = None, chunk_bytes: int = 1 << 30):
        """Chunks of (HF name, tensor on this backend's device) in ``dtype`` (default: the
        training precision). Rank 0 yields; the others iterate for the collectives."""
        if chunk_bytes < 1:
            raise ValueError(f"export_weights: chunk_bytes must be >= 1, got {chunk_bytes}")
        dtype = torch_dtype(dtype) or self.compute_dtype
        if self.policy.lora.enabled:  # merged in fp32 (gathered in the master dtype), then cast
            cfg = self.policy.lora
            full = iter_hf_tensors(self.model, self.master_dtype, self.device, dist.get_rank())
            yield from chunked(lora.merged(full, cfg.alpha / cfg.rank, dtype), chunk_bytes)
            return
        named = iter_hf_tensors(self.model, dtype, self.device, dist.get_rank())
        yield from chunked(named, chunk_bytes)

    def export_hf(self, path: str, dtype: Any = None, shard_bytes: int = 5 << 30) -> None:
        """Safetensors + config + tokenizer, in ``dtype`` (default: the loaded checkpoint's dtype)."""
        dtype = torch_dtype(dtype) or _config_dtype(self.hf_config) or self.compute_dtype
        write_hf_checkpoint(self.export_weights(dtype, shard_bytes), path, self.hf_config, dtype,
                            self.policy.tokenizer_name or self.policy.model_name, model_dir=self.policy.model_name,
                            rank=dist.get_rank())
        if self.policy.lora.enabled:
            adapters = {}
            for name, param in self.model.named_parameters():
                if ".lora_" in name:
                    full = gather_full(param, self.master_dtype, self.device)  # a collective on every rank
                    if dist.get_rank() == 0:
                        adapters[hf_name(name)] = full
            if dist.get_rank() == 0:
                lora.write_adapter(Path(path) / "adapter", lora.adapter_tensors(iter(adapters.items())),
                                   self.policy.lora, self.policy.model_name)
        dist.barrier()

    def save_checkpoint(self, path: str) -> None:
        checkpoint.save(path, self.model, self.optimizer, self.scheduler, self.step, self.hf_config, self.device)

    def load_checkpoint(self, path: str) -> None:
        self.step = checkpoint.load(path, self.model, self.optimizer, self.scheduler, self.hf_config, self.device)
        # Loaded param groups carry the saving run's kernel choice (fused or not, e.g. saved with
        # CPU offload); this run's choice decides where _update clips and skips.
        for group in self.optimizer.param_groups:
            group["fused"], group["foreach"] = self.optimizer.defaults["fused"], self.optimizer.defaults["foreach"]

    def offload(self, *, keep_weights: bool = False) -> None:
        self._reshard()
        self.offloader.offload(state_tensors(self.model, self.optimizer, weights=not keep_weights), self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        self.offloader.onload()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        self.offloader.saved = []
        self.model = self.optimizer = self.scheduler = self.reference = None  # type: ignore[assignment]
        self.params, self.fsdp_modules = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if getattr(self, "_fast_paths", False):
            self._fast_paths = False
            one_rank.uninstall()

    def _reshard(self) -> None:
        for module in self.fsdp_modules:
            module.reshard()


def _fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _empty_cache_after_train(world: WorldInfo, cfg: DTensorConfig) -> bool:
    if cfg.experimental.empty_cache_after_train is not None:
        return cfg.experimental.empty_cache_after_train
    return world.placement.colocated


def _config_dtype(hf_config: Any) -> torch.dtype | None:
    dtype = getattr(hf_config, "dtype", None)
    try:
        return torch_dtype(dtype)
    except ValueError:
        return None
