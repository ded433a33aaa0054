"""PPO's pieces against numbers worked out by hand: per-token rewards, GAE, returns, whitening,
the clipped value loss, and the algorithm's contract (warm-up, fields it needs, old logprobs).
Batch-geometry invariance of both losses is in test_invariance.py."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algorithms import gae
from rlcore.algorithms.config import PPOConfig
from rlcore.algorithms.ppo import PPO
from rlcore.algorithms.value_loss import ValueLoss
from rlcore.interfaces import SequenceBatch
from rlcore.data.packing import make_micro_batches, step_totals


def batch_of(masks: list[list[float]], **token_fields) -> SequenceBatch:
    ids = [torch.arange(3, 3 + len(m)) for m in masks]
    fields = {k: [torch.tensor(x, dtype=torch.float32) for x in v] for k, v in token_fields.items()}
    return SequenceBatch(input_ids=ids, loss_mask=[torch.tensor(m) for m in masks], token_fields=fields)


def values_of(rows: list[list[float]]) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


def test_gae_and_returns_by_hand():
    # one response of 3 tokens after a 2-token prompt; V before each response token; reward 1 at the end
    batch = batch_of([[0, 0, 1, 1, 1]])
    algo = PPO(PPOConfig(gamma=0.9, gae_lambda=0.8, whiten_advantages=False))
    fields, metrics = algo.token_targets(batch, values_of([[0, 0, 0.5, 0.2, -0.1]]), torch.tensor([1.0]))
    # d3 = 1 + 0 - (-0.1) = 1.1                      A3 = 1.1
    # d2 = 0 + 0.9 * (-0.1) - 0.2 = -0.29            A2 = -0.29 + 0.72 * 1.1 = 0.502
    # d1 = 0 + 0.9 * 0.2 - 0.5 = -0.32               A1 = -0.32 + 0.72 * 0.502 = 0.04144
    want_adv = torch.tensor([0, 0, 0.04144, 0.502, 1.1])
    assert torch.allclose(fields["advantages"][0], want_adv, atol=1e-6)
    assert torch.allclose(fields["returns"][0], want_adv + torch.tensor([0, 0, 0.5, 0.2, -0.1]), atol=1e-6)
    assert torch.allclose(fields["values"][0], torch.tensor([0, 0, 0.5, 0.2, -0.1]))
    assert metrics["critic/returns_mean"] == pytest.approx((0.54144 + 0.702 + 1.0) / 3, abs=1e-6)


def test_gamma_lambda_one_gives_reward_minus_value():
    batch = batch_of([[0, 1, 1, 1]])
    algo = PPO(PPOConfig(whiten_advantages=False))  # gamma = lambda = 1 (the defaults)
    fields, _ = algo.token_targets(batch, values_of([[0, 0.25, 0.5, 0.75]]), torch.tensor([2.0]))
    assert torch.allclose(fields["advantages"][0], torch.tensor([0, 1.75, 1.5, 1.25]))
    assert torch.allclose(fields["returns"][0], torch.tensor([0, 2.0, 2.0, 2.0]))


def test_observation_tokens_are_not_steps():
    # a multi-turn response: token 3 is the environment's (mask 0); it neither discounts nor earns
    batch = batch_of([[0, 0, 1, 0, 1]])
    algo = PPO(PPOConfig(gamma=0.5, gae_lambda=1.0, whiten_advantages=False))
    fields, _ = algo.token_targets(batch, values_of([[0, 0, 0.4, 9.0, 0.3]]), torch.tensor([1.0]))
    # steps: token 2 (V 0.4) then token 4 (V 0.3): A4 = 1 - 0.3 = 0.7; A2 = 0.5 * 0.3 - 0.4 + 0.5 * 0.7 = 0.1
    assert torch.allclose(fields["advantages"][0], torch.tensor([0, 0, 0.1, 0, 0.7]), atol=1e-6)
    assert float(fields["returns"][0][3]) == 0.0  # not a step: no target either


def test_kl_penalty_in_the_reward():
    old = [[0, 0, -1.0, -2.0]]
    ref = [[0, 0, -1.5, -1.0]]
    batch = batch_of([[0, 0, 1, 1]], old_logprobs=old, ref_logprobs=ref)
    algo = PPO(PPOConfig(kl_penalty_coef=0.1, whiten_advantages=False))
    assert algo.uses_reference and algo.uses_old_logprobs
    fields, metrics = algo.token_targets(batch, values_of([[0, 0, 0, 0]]), torch.tensor([1.0]))
    # k1 = log p_old - log p_ref = [0.5, -1.0] -> r = [-0.05, 1 + 0.1]; gamma = lambda = 1, V = 0
    assert torch.allclose(fields["advantages"][0], torch.tensor([0, 0, 1.05, 1.1]), atol=1e-6)
    assert metrics["critic/token_reward_mean"] == pytest.approx((-0.05 + 1.1) / 2)
    with pytest.raises(ValueError, match="old_logprobs"):
        algo.token_targets(batch_of([[0, 1, 1]]), values_of([[0, 0, 0]]), torch.tensor([1.0]))


def test_whitening_over_every_valid_token_of_the_step():
    batch = batch_of([[0, 1, 1], [0, 0, 1, 1, 1]])
    algo = PPO(PPOConfig())
    values = values_of([[0, 0.1, 0.3], [0, 0, -0.2, 0.4, 0.0]])
    fields, _ = algo.token_targets(batch, values, torch.tensor([1.0, 0.0]))
    raw = torch.tensor([0.9, 0.7, 0.2, -0.4, 0.0], dtype=torch.float64)  # R - V (gamma = lambda = 1)
    want = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=True) + 1e-8)
    got = torch.cat([fields["advantages"][0][1:], fields["advantages"][1][2:]]).double()
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(fields["returns"][0], torch.tensor([0, 1.0, 1.0]))  # returns are not whitened
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        algo.token_targets(batch_of([[0, 1]]), values_of([[0, 0]]), torch.tensor([1.0]))


def test_bad_values_are_named():
    algo = PPO(PPOConfig())
    batch = batch_of([[0, 1, 1]])
    with pytest.raises(ValueError, match="token 2 of sequence 0 is nan"):
        algo.token_targets(batch, values_of([[0, 0.1, math.nan]]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="returned 2 value tensors for 1"):
        algo.token_targets(batch, values_of([[0, 0, 0], [0, 0, 0]]), torch.tensor([1.0]))


def value_loss_of(loss: ValueLoss, values: list[float], old: list[float], returns: list[float]):
    batch = batch_of([[0] + [1] * len(values)], values=[[0] + old], returns=[[0] + returns])
    (mb,) = make_micro_batches(batch, 64)
    return loss.loss(torch.tensor([0.0] + values, dtype=torch.float64), mb, step_totals(batch))


def test_clipped_value_loss_by_hand():
    loss, metrics = value_loss_of(ValueLoss(0.2), values=[0.9, 0.0], old=[0.5, 0.5], returns=[1.0, 1.0])
    # token 1: (0.9-1)^2 = 0.01, clipped 0.5+0.2 = 0.7: (0.7-1)^2 = 0.09 -> 0.09 (the clip binds)
    # token 2: (0-1)^2 = 1,      clipped 0.5-0.2 = 0.3: (0.3-1)^2 = 0.49 -> 1
    assert float(loss) == pytest.approx(0.5 * (0.09 + 1.0) / 2)
    assert float(metrics["value_clip_fraction"]) == pytest.approx(0.5)
    assert float(metrics["value_error"]) == pytest.approx((0.1 + 1.0) / 2)
    unclipped, _ = value_loss_of(ValueLoss(None), values=[0.9, 0.0], old=[0.5, 0.5], returns=[1.0, 1.0])
    assert float(unclipped) == pytest.approx(0.5 * (0.01 + 1.0) / 2)


def test_value_loss_gradient_is_the_regression_error():
    batch = batch_of([[0, 1, 1]], values=[[0, 0.5, 0.5]], returns=[[0, 1.0, 0.2]])
    (mb,) = make_micro_batches(batch, 64)
    values_T = torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64, requires_grad=True)
    loss, _ = ValueLoss(0.2).loss(values_T, mb, step_totals(batch))
    loss.backward()
    # inside the clip range both terms are equal: d/dV 1/2 (V - G)^2 / 2 tokens = (V - G) / 2
    assert torch.allclose(values_T.grad, torch.tensor([0.0, (0.6 - 1.0) / 2, (0.4 - 0.2) / 2], dtype=torch.float64))


def test_policy_loss_needs_the_critic_step_fields():
    algo = PPO(PPOConfig(use_old_logprobs=False))
    batch = batch_of([[0, 1, 1]], advantages=[[0, 1.0, 1.0]])
    (mb,) = make_micro_batches(batch, 64)
    with pytest.raises(ValueError, match="'returns' is missing .*critic step"):
        algo.loss(torch.zeros(3), mb, step_totals(batch))


def test_warmup_and_old_logprobs():
    algo = PPO(PPOConfig(critic_warmup_steps=2))
    assert [algo.trains_policy(s) for s in (1, 2, 3)] == [False, False, True]
    assert algo.advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0])).tolist() == [0.0, 0.0]
    assert algo.choose_old_logprobs(True) is False  # as grpo: one update per batch needs no old pass
    assert PPO(PPOConfig(kl_penalty_coef=0.1)).choose_old_logprobs(True) is True  # the reward's KL reads them
    with pytest.raises(ValueError, match="use_old_logprobs must be true or auto"):
        PPO(PPOConfig(kl_penalty_coef=0.1, use_old_logprobs=False))


def test_config_errors_name_the_key():
    from rlcore.config import ConfigError
    from rlcore.loading.loader import build_config

    with pytest.raises((ConfigError, ValueError), match="gae_lambda"):
        PPOConfig(gae_lambda=1.5)
    with pytest.raises(ConfigError, match="critic.lrr"):
        build_config({"policy": {"model_name": "m"}, "algorithm": {"name": "ppo", "critic": {"lrr": 1e-5}}})


def test_step_and_summary_tables_show_the_critic_phases():
    """NeMo-RL's step-time format with PPO's two phases after Logprobs; a critic-free run's tables keep theirs."""
    import io

    from rich.console import Console

    from rlcore.controller.report import Reporter
    from rlcore.controller.run_end import summary_table

    def printed(record: dict) -> str:
        out = io.StringIO()
        reporter = Reporter(1, console=Console(file=out, width=200))
        reporter.step(record, 1)
        out.write("\n")
        summary = {"window_first": 1, "window_last": 1, **{k: v for k, v in record.items() if k.startswith("timing/")}}
        reporter.console.print(summary_table(summary, "summary"))
        return out.getvalue()

    ppo = printed({"step": 1, "timing/total": 3.0, "timing/logprobs": 0.5, "timing/values": 0.25, "timing/critic_train": 0.75})
    header, _legend, cells = ppo.splitlines()[:3]
    assert header.split()[header.split().index("logprobs") + 1:][:2] == ["values", "critic"]
    assert cells.split().index("0.50") + 1 == cells.split().index("0.25") == cells.split().index("0.75") - 1  # lp, values, critic
    assert "Values" in ppo and "Critic" in ppo
    grpo = printed({"step": 1, "timing/total": 3.0, "timing/logprobs": 0.5})
    assert "values" not in grpo.lower() and "critic" not in grpo.lower()
