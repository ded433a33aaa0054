"""The refit probe: after each refit the generator scores a few of the step's sequences, and its
logprobs must match the trainer's (``policy.generation.refit``: ``probe_num_sequences``,
``probe_threshold``). A refit that left a layer stale, or a logprob pass that went wrong on either
side, shows as a mean gap far above bf16's noise and stops the run with :class:`RefitError`.
"""

from __future__ import annotations

import math

import attrs
import torch

from rlcore.interfaces import SequenceBatch


class RefitError(RuntimeError):
    """After a refit the generator's logprobs disagree with the trainer's beyond the threshold."""


def refit_probe_sequences(batch: SequenceBatch, count: int, max_len: int | None = None) -> SequenceBatch:
    """The refit probe's sequences: the step's first ``count``, without the generator's MoE routing,
    each cut to ``max_len - 1`` tokens when ``max_len`` (``policy.max_total_sequence_length``) is given.

    The cut: a generator scores a sequence by prefilling it and sampling one token more, so a
    sequence that filled the whole length limit (prompt + response at ``max_len``) cannot be scored
    as it is; the logprobs of its first ``max_len - 1`` tokens do not depend on the last, so both
    sides compare those.

    That routing (R3) was chosen at the weights before this refit, while the generator scores the
    probe with the new ones and its own router; the trainer keeps its own router's choice too, so the
    probe compares the two networks' weights, not one network's routing with another's.
    """
    probe = attrs.evolve(batch.select(range(min(count, len(batch)))), routed_experts=None)
    if max_len is None or all(len(ids) < max_len for ids in probe.input_ids):
        return probe
    keep = max_len - 1
    return attrs.evolve(probe, input_ids=[ids[:keep] for ids in probe.input_ids],
                        loss_mask=[m[:keep] for m in probe.loss_mask],
                        token_fields={k: [v[:keep] for v in values] for k, values in probe.token_fields.items()})


def compare_probe_logprobs(probe: SequenceBatch, gen_lp: list, train_lp: list, threshold: float, step: int) -> dict:
    """The generator's logprobs of the probe's sequences against the trainer's, on the model's tokens:
    ``|log p_gen - log p_train|`` per token, its max and mean; raises :class:`RefitError` when the mean
    is above ``threshold`` or either is not finite."""
    masks = [m > 0 for m in probe.loss_mask]
    gen_T = torch.cat([torch.as_tensor(g, dtype=torch.float32)[k] for g, k in zip(gen_lp, masks)] or [torch.zeros(0)])
    train_T = torch.cat([t.float()[k] for t, k in zip(train_lp, masks)] or [torch.zeros(0)])
    diff_T = (gen_T - train_T).abs() if gen_T.numel() else torch.zeros(1)
    worst, mean = float(diff_T.max()), float(diff_T.mean())
    # The mean is what a corrupt refit moves (every token of a stale layer); the max of a few
    # thousand bf16 tokens can reach ~1 on a peaked distribution with correct weights.
    if not (math.isfinite(worst) and math.isfinite(mean)) or mean > threshold:
        # Which side is off: the weights moved by one update since the tokens were sampled, so
        # the correct side's mean logprob stays near the sampling pass's.
        means = f"mean logprob: generator {float(gen_T.mean()):.3g}, trainer {float(train_T.mean()):.3g}"
        rollout_lp = probe.token_fields.get("gen_logprobs")  # the sampling pass's, at the weights before
        if rollout_lp is not None:
            rollout_T = torch.cat([lp.float()[k] for lp, k in zip(rollout_lp, masks)])
            means += f", the rollout's own at the weights before {float(rollout_T.mean()):.3g}"
        raise RefitError(
            f"refit verification failed at step {step}: generator and trainer logprobs differ by "
            f"{mean:.3g} on average (max {worst:.3g}) over {diff_T.numel()} probe tokens "
            f"(policy.generation.refit.probe_threshold={threshold}): the generator does not hold the trainer's "
            f"weights, or one side's logprob pass is wrong ({means})"
        )
    return {"refit/probe_max_abs_logprob_diff": worst, "refit/probe_mean_abs_logprob_diff": mean}
