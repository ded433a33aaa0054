"""Earlier segments of agent trajectories into the training batch, with their trajectory's advantage.

A trajectory whose agent rewrote its history holds several token sequences (:mod:`rlcore.agents.recorder`):
the last is the trajectory's result, the earlier ones are in ``GenerationResult.segments``. The
advantage is computed once per trajectory (one reward, one member of its group); each earlier
segment then joins the batch as a sequence of its own carrying that advantage and reward, after
all trajectories, so the batch's first N rows stay the N trajectories. A trajectory the algorithm
filtered out (its loss mask zeroed) has its segments zeroed too.
"""

from __future__ import annotations

from typing import Any

import torch


def with_segments(batch, trajectories: list[Any], advantages_N: torch.Tensor, keep_N: torch.Tensor, max_len: int):
    """``batch`` with every trajectory's earlier segments appended (``batch`` itself when none has any)."""
    from rlcore.generation.batching import Trajectory, to_sequence_batch

    extra, extra_adv, extra_keep = [], [], []
    for i, traj in enumerate(trajectories):
        for segment in traj.result.segments or ():
            extra.append(Trajectory(traj.sample, traj.group, segment, traj.reward, traj.env_metrics))
            extra_adv.append(float(advantages_N[i]))
            extra_keep.append(bool(keep_N[i]))
    if not extra:
        return batch
    more = to_sequence_batch(extra, torch.tensor(extra_adv, dtype=torch.float32), max_len)
    for j, keep in enumerate(extra_keep):
        if not keep:
            more.loss_mask[j] = torch.zeros_like(more.loss_mask[j])
    batch.input_ids += more.input_ids
    batch.loss_mask += more.loss_mask
    for name, values in more.token_fields.items():
        batch.token_fields[name] = batch.token_fields[name] + values
    for name, values in more.seq_fields.items():
        batch.seq_fields[name] = torch.cat([batch.seq_fields[name], values])
    if batch.routed_experts is not None or more.routed_experts is not None:
        raise ValueError("MoE routing replay with agent segments is not supported: the endpoint does not record routing")
    return batch
