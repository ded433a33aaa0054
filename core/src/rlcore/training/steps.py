"""The outer layer every training backend shares, around the one call a backend implements.

``TrainingBackend.train(batch, algorithm)`` is, for every backend: split the step's sequences into
optimizer steps of ``policy.train_global_batch_size`` (all of them when unset), run the backend's
per-optimizer-step call on each (:class:`OptimizerStep`), and combine the results
(:func:`combine_optimizer_steps`). Inside its step a backend sums metrics over its micro-batches
and then over data-parallel ranks (:func:`sum_over_ranks`), moves micro-batches with
:meth:`rlcore.data.packing.MicroBatch.to`, and writes Hugging Face checkpoints with
:func:`rlcore.training.weights.write_hf_checkpoint`.
"""

from __future__ import annotations

from typing import Any, Protocol

from rlcore.interfaces import SequenceBatch, WorldInfo


class OptimizerStep(Protocol):
    """A backend's one optimizer step on ``batch`` (its whole share of the step's sequences):
    returns the step's metrics summed over micro-batches and data-parallel ranks, plus ``loss``,
    ``grad_norm``, ``lr``, ``num_micro_batches``, and ``skipped_nonfinite: 1.0`` when a non-finite
    loss or gradient skipped the update."""

    def __call__(self, batch: SequenceBatch) -> dict[str, float]: ...


def train_in_optimizer_steps(batch: SequenceBatch, global_batch_size: int | None, step: OptimizerStep,
                             who: str) -> dict[str, float]:
    """``step`` on each consecutive ``global_batch_size`` sequences of ``batch`` (all of them when
    None), combined by :func:`combine_optimizer_steps`. ``who`` names the backend in errors."""
    if len(batch) == 0:
        raise ValueError(f"{who}: train() got an empty batch")
    size = global_batch_size or len(batch)
    return combine_optimizer_steps([step(batch.select(range(start, min(start + size, len(batch)))))
                                    for start in range(0, len(batch), size)])


def combine_optimizer_steps(results: list[dict[str, float]]) -> dict[str, float]:
    """Mean over optimizer steps of each metric (``*_max``: the largest); ``num_micro_batches`` summed, ``lr`` the last
    step's, ``num_optimizer_steps`` the steps that updated the weights and ``skipped_nonfinite``
    (present only when some were skipped) the ones that did not."""
    keys = {k for r in results for k in r}
    out = {k: sum(r.get(k, 0.0) for r in results) / len(results) for k in keys}
    out.update({k: max(r[k] for r in results if k in r) for k in keys if k.endswith("_max")})  # merge_metric's rule
    out["num_micro_batches"] = float(sum(r["num_micro_batches"] for r in results))
    out["lr"] = results[-1]["lr"]
    skipped = sum(r.get("skipped_nonfinite", 0.0) for r in results)
    out["num_optimizer_steps"] = float(len(results) - skipped)
    if skipped:
        out["skipped_nonfinite"] = float(skipped)
    return out


def sum_over_ranks(metrics: dict[str, float], group: Any = None) -> dict[str, float]:
    """Each metric summed over the ranks of ``group`` (default: all; ``*_max`` metrics by maximum:
    :func:`rlcore.algorithms.base.merge_metric`), every rank getting the result.
    Gathered as objects: a rank that holds no values (only padding micro-batches, or a tensor- or
    pipeline-parallel peer whose copies are not counted) passes fewer keys or none."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return dict(metrics)
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, metrics, group=group)
    from rlcore.algorithms.base import merge_metrics

    total: dict[str, float] = {}
    for part in parts:
        merge_metrics(total, part)
    return total


def check_world(world: WorldInfo, who: str) -> None:
    """torch.distributed is up with the world size the backend was told."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"{who}: torch.distributed must be initialized before the backend is built")
    if dist.get_world_size() != world.world_size:
        raise RuntimeError(f"{who}: WorldInfo says world_size={world.world_size} but torch.distributed "
                           f"has {dist.get_world_size()} ranks")


__all__ = ["OptimizerStep", "check_world", "combine_optimizer_steps", "sum_over_ranks", "train_in_optimizer_steps"]


class HostOffloader:
    """Releases a trainer's state to host memory and brings it back bit for bit, for
    ``policy.generation.colocated.offload_trainer_state``: each distinct storage is copied to host memory
    (pinned when it lives on a GPU, so the way back runs asynchronously) and resized to 0 bytes. Tensors,
    and every view and optimizer reference to them, stay the same objects, so nothing is re-wired on the
    way back; on CPU the storages are released and restored the same way. Written here, not taken from a
    library: torch's own offload paths (FSDP2's ``CPUOffloadPolicy``, Megatron's buffer offload) each
    cover one backend's tensors and re-create them, which would cut the optimizer's references."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self.saved: list[tuple[Any, Any]] = []  # (released storage, its host copy)

    @property
    def offloaded(self) -> bool:
        return bool(self.saved)

    def offload(self, tensors, device, *, keep=()) -> None:
        """Release the storages of ``tensors`` on ``device`` (once each; a no-op while offloaded), except
        those of ``keep`` (tensors whose storage must stay: the weights a refit reads)."""
        torch = self._torch
        if self.saved:
            return
        seen = {t.untyped_storage().data_ptr() for t in keep}
        pin = torch.device(device).type == "cuda"
        with torch.no_grad():
            for t in tensors:
                storage = t.untyped_storage()
                if t.device != torch.device(device) or storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))
                copy = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                copy.copy_(view)
                self.saved.append((storage, copy))
            for storage, _ in self.saved:
                storage.resize_(0)

    def onload(self) -> None:
        torch = self._torch
        with torch.no_grad():
            for storage, copy in self.saved:
                storage.resize_(copy.numel())
                view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (copy.numel(),))
                view.copy_(copy, non_blocking=True)
        self.saved = []
