"""Learning-rate schedule of ``policy.scheduler`` (in optimizer steps), as a LambdaLR factor.

Optimizer step ``k`` (0-based) uses

- warmup (``k < warmup_steps``): ``lr * (k + 1) / warmup_steps`` — linear from near 0, reaching
  ``lr`` at the last warmup step;
- then, with ``p = clamp((k - warmup_steps) / (decay_steps - warmup_steps), 0, 1)``:
  ``constant``: ``lr``; ``linear``: ``lr + (min_lr - lr) * p``;
  ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``.
"""

from __future__ import annotations

import math


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
