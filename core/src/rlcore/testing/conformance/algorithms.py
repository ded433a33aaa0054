"""The algorithm suite (:class:`AlgorithmConformance`): advantages and loss follow
:class:`rlcore.interfaces.Algorithm`, and a micro-batch's loss is its share of the step's loss; and
:func:`make_algorithm_batch`, the batch it checks them on."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rlcore.interfaces import Algorithm, CapturableLoss, RefillRounds
from rlcore.testing.conformance.members import assert_follows


def make_algorithm_batch(algorithm, *, num_groups: int = 3, group_size: int = 4, prompt_len: int = 3,
                         vocab_size: int = 64, seed: int = 0):
    """A step's batch with every token field an algorithm may need, plus leaf logprobs.

    Returns ``(batch, logprobs)``: ``logprobs[i]`` is a float64 leaf tensor [L_i] (index 0 is 0)
    standing for the current policy; old, reference and generator logprobs are near it, so
    importance ratios are near 1 and some are clipped.
    """
    import torch

    from rlcore.interfaces import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    n = num_groups * group_size
    rewards_N = (torch.rand(n, generator=g) > 0.5).double()
    rewards_N[:group_size] = 1.0  # one group with equal rewards (zero std)
    if num_groups > 1:
        rewards_N[group_size] = 0.0  # and one with both outcomes
    group_ids_N = torch.arange(num_groups).repeat_interleave(group_size)
    lengths = torch.randint(prompt_len + 2, prompt_len + 12, (n,), generator=g).tolist()
    truncated_N = torch.tensor([length == max(lengths) for length in lengths])
    response_lengths_N = torch.tensor([length - prompt_len for length in lengths])
    shaped_N = algorithm.shape_rewards(rewards_N, response_lengths_N, truncated_N)
    advantages_N = algorithm.advantages(shaped_N, group_ids_N)

    def near(base, scale):
        out = base + scale * torch.randn(base.shape, generator=g, dtype=torch.float64)
        out[0] = 0.0
        return out

    input_ids, loss_mask, old, ref, gen, teacher, logprobs = [], [], [], [], [], [], []
    for length in lengths:
        input_ids.append(torch.randint(3, vocab_size, (length,), generator=g))
        mask = torch.zeros(length)
        mask[prompt_len:] = 1.0
        loss_mask.append(mask)
        base = -3.0 * torch.rand(length, generator=g, dtype=torch.float64) - 0.05
        base[0] = 0.0
        old.append(base)
        ref.append(near(base, 0.1))
        gen.append(near(base, 0.05))
        teacher.append(near(base, 0.3))  # a teacher model's (on-policy distillation)
        logprobs.append(near(base, 0.15).requires_grad_(True))
    batch = SequenceBatch(
        input_ids=input_ids, loss_mask=loss_mask,
        token_fields={"old_logprobs": old, "ref_logprobs": ref, "gen_logprobs": gen, "teacher_logprobs": teacher},
        seq_fields={"rewards": shaped_N, "advantages": advantages_N.double()},
    )
    from rlcore.interfaces import CriticAlgorithm

    if isinstance(algorithm, CriticAlgorithm) and algorithm.uses_critic:  # ppo: per-token targets from a critic's values
        values = [near(torch.zeros(length, dtype=torch.float64), 0.5).float() for length in lengths]
        fields, _ = algorithm.token_targets(batch, values, shaped_N)
        batch.token_fields.update(fields)
    return batch, logprobs


def _packed(logprobs: list, mb) -> Any:
    import torch

    # Padding comes from the model too in a real backend: it carries a gradient (of zero), so an
    # empty micro-batch still gives a loss that backward() accepts.
    parts = [logprobs[i] for i in mb.seq_ids]
    parts.append(torch.zeros(mb.num_padding, dtype=torch.float64, requires_grad=True))
    return torch.cat(parts)


def _loss_over(algorithm, batch, logprobs, micro_batches, totals) -> tuple[Any, dict[str, float]]:
    """Sum of micro-batch losses (backward run on each) and of their metrics (``*_max`` by maximum)."""
    import torch

    from rlcore.algorithms.base import merge_metric

    total, metrics = torch.zeros((), dtype=torch.float64), {}
    for mb in micro_batches:
        loss, mb_metrics = algorithm.loss(_packed(logprobs, mb), mb, totals)
        assert loss.dim() == 0, f"loss must be a scalar, got shape {tuple(loss.shape)}"
        assert torch.isfinite(loss), f"non-finite loss {loss} on micro-batch {mb.seq_ids}"
        loss.backward()
        total = total + loss.detach().double()
        for key, value in mb_metrics.items():
            if isinstance(value, torch.Tensor):
                assert value.dim() == 0 and not value.requires_grad, f"metric {key!r} must be a detached 0-d tensor, got {value!r}"
                value = float(value)
            assert isinstance(value, float) and math.isfinite(value), f"metric {key!r} is {value!r}"
            metrics[key] = merge_metric(key, metrics[key], value) if key in metrics else value
    return total, metrics


class AlgorithmConformance:
    """Advantages and loss follow :class:`rlcore.interfaces.Algorithm`, and the loss of a
    micro-batch is its share of the step loss (global normalization)."""

    atol: float = 1e-9

    @pytest.fixture
    def algorithm_name(self) -> str | None:
        """The name the algorithm is registered under; None skips the registration test."""
        return None

    def test_implements_protocol(self, algorithm):
        assert_follows(algorithm, Algorithm)
        assert isinstance(algorithm.name, str) and algorithm.name
        assert isinstance(algorithm.uses_reference, bool) and isinstance(algorithm.uses_old_logprobs, bool)
        assert algorithm.loss_level in ("token", "sequence")

    def test_optional_members(self, algorithm):
        """The optional members an algorithm has (rlcore.algorithms.base.AlgorithmBase gives them all)."""
        if isinstance(algorithm, RefillRounds):
            rounds = algorithm.max_refill_rounds
            assert isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 0, \
                f"max_refill_rounds is {rounds!r}; it must be a whole number of rounds, 0 for none"
        if isinstance(algorithm, CapturableLoss):
            assert isinstance(algorithm.capturable_loss, bool), f"capturable_loss is {algorithm.capturable_loss!r}"

    def test_advantages_shape_and_finite(self, algorithm):
        import torch

        rewards_N = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
        group_ids_N = torch.arange(3).repeat_interleave(4)
        adv_N = algorithm.advantages(rewards_N, group_ids_N)
        assert adv_N.shape == (12,) and adv_N.is_floating_point()
        assert torch.isfinite(adv_N).all(), f"advantages {adv_N} (a group with equal rewards must not give NaN)"
        keep_N = algorithm.keep_trajectories(rewards_N, group_ids_N, torch.zeros(12, dtype=torch.bool))
        assert keep_N.shape == (12,) and keep_N.dtype == torch.bool
        shaped_N = algorithm.shape_rewards(rewards_N, torch.full((12,), 5), torch.zeros(12, dtype=torch.bool))
        assert shaped_N.shape == (12,) and torch.isfinite(shaped_N).all()

    def test_loss_finite_with_finite_gradient(self, algorithm):
        import torch

        from rlcore.data.packing import make_micro_batches, step_totals

        batch, logprobs = make_algorithm_batch(algorithm)
        totals = step_totals(batch)
        _loss_over(algorithm, batch, logprobs, make_micro_batches(batch, max_tokens=10_000), totals)
        grads = [lp.grad for lp in logprobs]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads), "the loss does not depend on the logprobs"

    @pytest.mark.parametrize("dp_size, max_tokens, pad", [(2, 10_000, 1), (1, 24, 1), (3, 16, 8)])
    def test_micro_batch_losses_sum_to_the_step_loss(self, algorithm, dp_size, max_tokens, pad):
        from rlcore.data.packing import make_micro_batches, step_totals

        batch, logprobs = make_algorithm_batch(algorithm)
        totals = step_totals(batch)
        whole, whole_metrics = _loss_over(algorithm, batch, logprobs, make_micro_batches(batch, max_tokens=10_000), totals)
        whole_grads = [lp.grad.clone() for lp in logprobs]
        for lp in logprobs:
            lp.grad = None
        split = [mb for rank in range(dp_size)
                 for mb in make_micro_batches(batch, max_tokens, rank, dp_size, pad_to_multiple=pad)]
        assert len(split) > 1
        parts, parts_metrics = _loss_over(algorithm, batch, logprobs, split, totals)
        assert float(parts) == pytest.approx(float(whole), abs=self.atol, rel=1e-9)
        for lp, grad in zip(logprobs, whole_grads):
            assert lp.grad is not None and (lp.grad - grad).abs().max() <= 1e-9 + 1e-9 * grad.abs().max()
        assert parts_metrics.keys() == whole_metrics.keys()
        for key in whole_metrics:
            assert parts_metrics[key] == pytest.approx(whole_metrics[key], abs=1e-9, rel=1e-6), f"metric {key!r} is not a share"

    def test_empty_micro_batch_is_a_zero_loss(self, algorithm):
        from rlcore.data.packing import make_micro_batches, step_totals

        batch, logprobs = make_algorithm_batch(algorithm, num_groups=1, group_size=2)
        micro_batches = make_micro_batches(batch, 10_000, dp_rank=2, dp_size=3, pad_to_multiple=4)
        assert micro_batches and all(mb.num_seqs == 0 for mb in micro_batches)
        for mb in micro_batches:
            loss, metrics = algorithm.loss(_packed(logprobs, mb), mb, step_totals(batch))
            assert float(loss.detach()) == 0.0 and all(v == 0.0 for v in metrics.values()), (loss, metrics)
            assert loss.requires_grad, "backends call backward() on every micro-batch, empty ones included"
            loss.backward()

    def test_masked_tokens_do_not_matter(self, algorithm):
        import torch

        from rlcore.data.packing import make_micro_batches, step_totals

        batch, logprobs = make_algorithm_batch(algorithm)
        (mb,) = make_micro_batches(batch, 10_000, pad_to_multiple=16)
        totals = step_totals(batch)
        logprobs_T = _packed(logprobs, mb).detach()
        changed_T = torch.where(mb.loss_mask_T > 0, logprobs_T, torch.full_like(logprobs_T, -50.0))
        assert float(algorithm.loss(changed_T, mb, totals)[0]) == pytest.approx(float(algorithm.loss(logprobs_T, mb, totals)[0]), abs=1e-12)

    def test_registered_with_config_class(self, algorithm, algorithm_name):
        if algorithm_name is None:
            pytest.skip("no algorithm_name fixture")
        import attrs

        from rlcore.config import structure
        from rlcore.plugins import get_plugin_manager

        reg = get_plugin_manager().get("algorithm", algorithm_name)
        assert reg.config_cls is not None and attrs.has(reg.config_cls), "register it with a frozen attrs config class"
        config = structure(reg.config_cls, {"name": algorithm_name}, reg.section)
        built = reg.build(config)
        assert isinstance(built, Algorithm) and built.name == algorithm_name
        assert type(built) is type(algorithm)


