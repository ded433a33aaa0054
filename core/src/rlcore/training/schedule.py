"""The learning-rate schedule of ``policy.scheduler``, for any training backend.

``policy.scheduler`` and ``policy.optimizer`` are core's keys, so their meaning is core's too: a
backend turns them into a ``torch.optim.lr_scheduler.LambdaLR`` with :func:`lr_lambda` instead of
re-deriving the formula. Optimizer step ``k`` (0-based) uses

- warmup (``k < warmup_steps``): ``lr * (k + 1) / warmup_steps`` — linear from near 0, reaching
  ``lr`` at the last warmup step;
- then, with ``p = clamp((k - warmup_steps) / (decay_steps - warmup_steps), 0, 1)``:
  ``constant``: ``lr``; ``linear``: ``lr + (min_lr - lr) * p``;
  ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``.

``decay_steps`` unset means ``train.max_num_steps``. Imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.config.schema import RunConfig


def lr_factor(step: int, *, warmup_steps: int, decay_style: str, decay_steps: int, lr: float, min_lr: float) -> float:
    """Multiplier of the peak ``lr`` at optimizer step ``step``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_style == "constant":
        return 1.0
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if decay_style == "linear":
        value = lr + (min_lr - lr) * progress
    elif decay_style == "cosine":
        value = min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"policy.scheduler.decay_style: unknown style {decay_style!r}")
    return value / lr


def lr_lambda(config: RunConfig) -> Callable[[int], float]:
    """``step -> multiplier`` of ``config``'s ``policy.scheduler``, as ``LambdaLR(optimizer, lr_lambda(config))`` takes."""
    sched, opt = config.policy.scheduler, config.policy.optimizer
    decay_steps = sched.decay_steps if sched.decay_steps is not None else config.train.max_num_steps

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=sched.warmup_steps, decay_style=sched.decay_style,
                         decay_steps=decay_steps, lr=opt.lr, min_lr=opt.min_lr)

    return factor


__all__ = ["lr_factor", "lr_lambda"]
