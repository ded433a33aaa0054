"""A training backend's ``offload``/``onload`` round trip, checked on its own state tensors: what a
backend's tests (and a third-party backend's CI) assert for ``policy.generation.colocated.offload_trainer_state``."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def release_round_trips(backend, state: Callable[[], Sequence], weights: Callable[[], Sequence]) -> dict[str, bool]:
    """``offload(keep_weights=True)`` then ``onload()``, and again with the weights released too. For each
    (``out_True``/``out_False``, ``equal_True``/``equal_False``): whether every tensor of ``state()`` had an
    empty storage while out, except those sharing a storage with ``weights()`` when they are kept, and
    whether each came back bitwise equal."""
    import torch

    out = {}
    for keep in (True, False):
        tensors = list(state())
        kept = {w.untyped_storage().data_ptr() for w in weights()}
        is_weight = [t.untyped_storage().data_ptr() in kept for t in tensors]
        before = [t.clone() for t in tensors]
        backend.offload(keep_weights=keep)
        out[f"out_{keep}"] = all((t.untyped_storage().nbytes() > 0) == (keep and w) for t, w in zip(tensors, is_weight))
        backend.onload()
        out[f"equal_{keep}"] = all(torch.equal(a, b) for a, b in zip(before, tensors))
    return out
