"""The ``ddp`` training backend: a Hugging Face causal LM under ``torch.nn.parallel.DistributedDataParallel``.

Every trainer rank holds the whole model (gloo on CPU, NCCL on CUDA) and takes its data-parallel
share of each step's sequences through :func:`rlcore.data.packing.make_micro_batches`. A micro-batch
comes in rlcore's flat packed layout (sequences concatenated), which the losses are written over;
the forward takes its sequences as right-padded rows with an attention mask (attention costs
``n * L_max**2``, not ``T**2`` as one packed row with a block mask would), and the per-token
logprobs are laid back flat. Each sequence is computed alone, so packing changes no logprobs.

rlcore's losses are global shares (divided by the whole step's token or sequence count,
:func:`rlcore.data.packing.step_totals`), so gradients must be **summed** over ranks, not averaged as
DDP does by default: a communication hook (:func:`sum_allreduce_hook`) all-reduces each bucket
with a plain sum. Gradients accumulate over micro-batches under ``no_sync`` and are reduced once,
in the last micro-batch's backward.

Public rlcore API only: :mod:`rlcore.interfaces` (what is built and called), :mod:`rlcore.data.packing`
and :mod:`rlcore.training.ops` (layout and logprobs), :mod:`rlcore.training.steps` (the ``train`` outer layer and
metric sums), :mod:`rlcore.training.schedule` (``policy.scheduler``) and :mod:`rlcore.training.weights` (chunks,
gather to rank 0, the Hugging Face writer).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rlcore.algorithms.base import merge_metrics
from rlcore.config import ConfigError, RunConfig
from rlcore.interfaces import Algorithm, SequenceBatch, WorldInfo
from rlcore.training.ops import token_logprobs
from rlcore.data.packing import MicroBatch, make_micro_batches, step_totals, unpack
from rlcore.training.schedule import lr_lambda
from rlcore.training.steps import check_world, sum_over_ranks, train_in_optimizer_steps
from rlcore.training.weights import chunked, gather_sequences_to_rank0, write_hf_checkpoint

from rlcore_ddp import checkpoint
from rlcore_ddp.config import DDPConfig

WHO = "ddp backend"
log = logging.getLogger(__name__)


def build_backend(config: RunConfig, section_config: DDPConfig | None, world: WorldInfo) -> DDPBackend:
    """Factory registered as ``ddp``: ``factory(config, section_config, world) -> TrainingBackend``."""
    return DDPBackend(config, section_config or DDPConfig(), world)


def sum_allreduce_hook(process_group, bucket):
    """DDP communication hook: the bucket's gradients summed over ranks (DDP's own divides by the
    world size). Unannotated: DDP checks the annotations, and this module's are strings."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class DDPBackend:
    """Implements :class:`rlcore.interfaces.TrainingBackend`."""

    def __init__(self, config: RunConfig, cfg: DDPConfig, world: WorldInfo):
        check_world(world, WHO)
        self.config, self.cfg, self.world, self.policy = config, cfg, world, config.policy
        if self.policy.precision == "float16":
            raise ConfigError("policy.precision", "float16 is not supported by the ddp backend (no loss scaling); use bfloat16")
        self.device = _device(world)
        self.compute_dtype = getattr(torch, self.policy.precision)
        # Master weights, gradients and optimizer state in fp32 (fp64 for float64 runs); bf16 runs autocast.
        self.master_dtype = torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        self.model = self._load_model()
        self.params = list(self.model.parameters())
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_cap_mb, find_unused_parameters=cfg.find_unused_parameters)
        self.ddp.register_comm_hook(None, sum_allreduce_hook)
        opt = self.policy.optimizer
        self.optimizer = torch.optim.AdamW(self.params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                           weight_decay=opt.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.reference = [p.detach().to("cpu", copy=True) for p in self.params]  # the frozen initial policy
        self.step = 0

    def _load_model(self) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(self.policy.model_name)
        if not (path / "config.json").is_file():
            raise ConfigError("policy.model_name", f"{str(path)!r} is not a local Hugging Face checkpoint directory "
                                                   "(no config.json); the ddp backend never downloads models")
        self.hf_config = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.master_dtype, attn_implementation="sdpa")
        model.config.use_cache = False
        return model.to(self.device)

    # ---- forward ---------------------------------------------------------------------------
    def _micro_batches(self, batch: SequenceBatch, *, train: bool) -> list[MicroBatch]:
        packing = self.policy.sequence_packing
        return make_micro_batches(
            batch, packing.train_mb_tokens if train else packing.logprob_mb_tokens, self.world.rank, self.world.world_size,
            pack=packing.enabled, micro_batch_size=self.policy.train_micro_batch_size if train else self.policy.logprob_batch_size)

    def _forward_logprobs(self, module: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """Token-aligned logprobs [T] of a micro-batch on this backend's device, in its flat layout
        (0 on the trailing padding, which the loss masks)."""
        autocast = torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != self.master_dtype)
        if mb.num_seqs == 0:  # padding only: still a forward (and later a backward) through every parameter
            with autocast:
                logits_1TV = module(input_ids=mb.input_ids_T[None], use_cache=False).logits
            return token_logprobs(logits_1TV.squeeze(0), mb.input_ids_T)
        lengths = mb.cu_seqlens.diff().tolist()
        real = int(mb.cu_seqlens[-1])
        ids_NL, mask_NL = self._rows(mb.input_ids_T[:real], lengths)
        with autocast:
            logits_NLV = module(input_ids=ids_NL, attention_mask=mask_NL, use_cache=False).logits
        logits_TV = logits_NLV[mask_NL.bool()]  # row-major: the sequences back to back, as packed
        logprobs_T = token_logprobs(logits_TV, mb.input_ids_T[:real], mb.cu_seqlens, chunk_tokens=self.cfg.logprob_chunk_tokens)
        return torch.cat([logprobs_T, logprobs_T.new_zeros(mb.num_tokens - real)])

    @staticmethod
    def _rows(ids_T: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat sequences as right-padded rows [N, L_max] and their attention mask."""
        width = max(lengths)
        ids_NL = ids_T.new_zeros((len(lengths), width))
        mask_NL = ids_T.new_zeros((len(lengths), width))
        for row, seq_ids_L in enumerate(torch.split(ids_T, lengths)):
            ids_NL[row, : len(seq_ids_L)] = seq_ids_L
            mask_NL[row, : len(seq_ids_L)] = 1
        return ids_NL, mask_NL

    # ---- TrainingBackend -------------------------------------------------------------------
    def logprobs(self, batch: SequenceBatch, *, reference: bool = False) -> list[torch.Tensor] | None:
        with self._reference_swapped_in() if reference else contextlib.nullcontext():
            return self._logprobs(batch)

    @torch.no_grad()
    def _logprobs(self, batch: SequenceBatch) -> list[torch.Tensor] | None:
        self.model.eval()
        mine: dict[int, torch.Tensor] = {}
        for mb in self._micro_batches(batch, train=False):
            logprobs_T = self._forward_logprobs(self.model, mb.to(self.device)).float().cpu()  # no DDP: no gradients
            for seq_id, values in zip(mb.seq_ids, unpack(logprobs_T, mb)):
                mine[seq_id] = values.clone()
        return gather_sequences_to_rank0(mine, len(batch), WHO)

    @contextlib.contextmanager
    def _reference_swapped_in(self) -> Iterator[None]:
        with torch.no_grad():
            current = [p.detach().to("cpu", copy=True) for p in self.params]
            for p, ref in zip(self.params, self.reference):
                p.copy_(ref)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, cur in zip(self.params, current):
                    p.copy_(cur)

    def train(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        self.model.train()
        return train_in_optimizer_steps(batch, self.policy.train_global_batch_size,
                                        lambda part: self._train_step(part, algorithm), WHO)

    def _train_step(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        totals = step_totals(batch)  # of the whole optimizer step, over every rank
        micro_batches = self._micro_batches(batch, train=True)  # the same number on every rank
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        metrics: dict[str, Any] = {}
        for index, mb in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():  # reduce once, in the last backward
                mb = mb.to(self.device)
                logprobs_T = self._forward_logprobs(self.ddp, mb)
                if mb.num_seqs == 0:  # padding only: a zero loss that still runs backward, keeping ranks in step
                    loss, mb_metrics = logprobs_T.sum() * 0.0, {}
                else:
                    loss, mb_metrics = algorithm.loss(logprobs_T, mb, totals)
                loss.backward()
            loss_sum += loss.detach().to(torch.float64)
            merge_metrics(metrics, {k: v.detach() if torch.is_tensor(v) else v for k, v in mb_metrics.items()})
        return self._update(loss_sum, metrics, len(micro_batches))

    def _update(self, loss_sum: torch.Tensor, metrics: dict[str, Any], num_micro_batches: int) -> dict[str, float]:
        """Clip and step (every rank holds the same summed gradients, so every rank steps alike),
        or skip the update when the loss or the gradient norm is not finite."""
        if self.world.world_size > 1:
            dist.all_reduce(loss_sum)
        metrics = sum_over_ranks({k: float(v) for k, v in metrics.items()})
        max_norm = self.policy.max_grad_norm
        grads = [p.grad for p in self.params if p.grad is not None]
        if max_norm is not None and max_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm(grads))
        loss = float(loss_sum)
        result = {**metrics, "loss": loss, "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
                  "num_micro_batches": float(num_micro_batches)}
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not finite:
            log.warning("%s: non-finite loss %s / grad norm %s; skipping the update", WHO, loss, grad_norm)
            return {**result, "skipped_nonfinite": 1.0}
        self.scheduler.step()
        self.step += 1
        return result

    # ---- weights and checkpoints -------------------------------------------------------------
    def export_weights(self, dtype: Any = None, chunk_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Chunks of (Hugging Face name, tensor) in ``dtype`` (default: the training precision), from
        rank 0; every rank holds the whole model, so the others have nothing to send."""
        if chunk_bytes < 1:
            raise ValueError(f"{WHO}: export_weights chunk_bytes must be >= 1, got {chunk_bytes}")
        if self.world.rank != 0:
            return
        dtype = _dtype(dtype) or self.compute_dtype
        yield from chunked(self._hf_tensors(dtype), chunk_bytes)

    def _hf_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        # In-memory layouts that differ from the checkpoint's (fused MoE experts) go back to checkpoint names.
        from transformers.core_model_loading import revert_weight_conversion

        for name, param in self.model.named_parameters():
            yield from revert_weight_conversion(self.model, {name: param.detach().to(dtype)}).items()

    def export_hf(self, path: str, dtype: Any = None) -> None:
        """Safetensors + config + tokenizer, in ``dtype`` (default: the training precision)."""
        dtype = _dtype(dtype) or self.compute_dtype
        write_hf_checkpoint(self.export_weights(dtype, 5 << 30), path, self.hf_config, dtype,
                            self.policy.tokenizer_name or self.policy.model_name, model_dir=self.policy.model_name,
                            rank=self.world.rank)
        dist.barrier()

    def save_checkpoint(self, path: str) -> None:
        checkpoint.save(path, self.model, self.optimizer, self.scheduler, self.step)

    def load_checkpoint(self, path: str) -> None:
        self.step = checkpoint.load(path, self.model, self.optimizer, self.scheduler)

    def shutdown(self) -> None:
        self.ddp = self.model = self.optimizer = self.scheduler = None  # type: ignore[assignment]
        self.params, self.reference = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _device(world: WorldInfo) -> torch.device:
    if world.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{WHO}: WorldInfo.device is 'cuda' but CUDA is not available")
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def _dtype(dtype: Any) -> torch.dtype | None:
    """A torch dtype from a torch dtype, a name (``"bfloat16"``, ``"torch.float32"``) or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{WHO}: unknown dtype {dtype!r}")
    return found
