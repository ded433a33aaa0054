"""Each built-in algorithm against hand-computed values on a small fixed example, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algorithms import config as C
from rlcore.algorithms.base import clipped_surrogate, merge_metrics
from rlcore.algorithms.dapo import DAPO
from rlcore.algorithms.dr_grpo import DrGRPO
from rlcore.algorithms.grpo import GRPO
from rlcore.algorithms.gspo import GSPO
from rlcore.algorithms.reinforce_pp import ReinforcePP
from rlcore.algorithms.rloo import RLOO
from rlcore.algorithms.sft import SFT
from rlcore.interfaces import Algorithm, SequenceBatch
from rlcore.data.packing import make_micro_batches, step_totals

# Two sequences: A = 3 tokens (2 valid), B = 4 tokens (3 valid). Old policy p_old = 0.5 on every
# token; the current policy gives ratios A: [1.0, 1.5], B: [0.5, 1.1, 0.9]. Advantages A: +1, B: -1.
RATIOS = {0: [1.0, 1.5], 1: [0.5, 1.1, 0.9]}
ADV = {0: 1.0, 1: -1.0}
# Hand-computed PPO token losses max(-rA, -clip(r, 0.8, 1.2)A):
#   A: r=1.0 -> -1.0; r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped)
#   B: r=0.5 -> max(0.5, 0.8) = 0.8 (clipped); r=1.1 -> 1.1; r=0.9 -> 0.9
TOKEN_LOSSES = {0: [-1.0, -1.2], 1: [0.8, 1.1, 0.9]}


def _example(ref_log_ratio=None, gen_log_w=None):
    """SequenceBatch and per-sequence current logprobs (float64, requires grad)."""
    old = math.log(0.5)
    ids, masks, fields, logprobs = [], [], {"advantages": [], "old_logprobs": []}, []
    if ref_log_ratio is not None:
        fields["ref_logprobs"] = []
    if gen_log_w is not None:
        fields["gen_logprobs"] = []
    for i, ratios in RATIOS.items():
        n = len(ratios) + 1
        ids.append(torch.arange(3, 3 + n))
        masks.append(torch.tensor([0.0] + [1.0] * len(ratios)))
        lp = torch.tensor([0.0] + [old + math.log(r) for r in ratios], dtype=torch.float64)
        logprobs.append(lp)
        fields["advantages"].append(torch.full((n,), ADV[i], dtype=torch.float64))
        fields["old_logprobs"].append(torch.tensor([0.0] + [old] * len(ratios), dtype=torch.float64))
        if ref_log_ratio is not None:  # log p_ref - log p, per valid token
            fields["ref_logprobs"].append(lp + torch.tensor([0.0] + [ref_log_ratio] * len(ratios), dtype=torch.float64))
        if gen_log_w is not None:  # log p_old - log p_gen, per valid token
            fields["gen_logprobs"].append(fields["old_logprobs"][i] - torch.tensor([0.0] + gen_log_w[i], dtype=torch.float64))
    batch = SequenceBatch(input_ids=ids, loss_mask=masks, token_fields=fields, seq_fields={"rewards": torch.tensor([1.0, 0.0])})
    return batch, logprobs


def _run(alg, batch, logprobs, max_tokens=64):
    """Sum of loss and metrics over micro-batches, and d loss / d logprobs per sequence."""
    totals = step_totals(batch)
    leaves = [lp.clone().requires_grad_(True) for lp in logprobs]
    total_loss, metrics = 0.0, {}
    for mb in make_micro_batches(batch, max_tokens):
        lp_T = torch.cat([leaves[i] for i in mb.seq_ids]) if mb.seq_ids else torch.zeros(mb.num_tokens, dtype=torch.float64)
        lp_T = torch.nn.functional.pad(lp_T, (0, mb.num_padding))
        loss, m = alg.loss(lp_T, mb, totals)
        if loss.requires_grad:
            loss.backward()
        total_loss += float(loss.detach())
        merge_metrics(metrics, {k: float(v) for k, v in m.items()})
    return total_loss, metrics, [lp.grad for lp in leaves]


@pytest.mark.parametrize("max_tokens", [64, 4])  # one micro-batch, or one per sequence
def test_grpo_token_level_hand_value(max_tokens):
    batch, lp = _example()
    loss, m, grads = _run(GRPO(C.GRPOConfig()), batch, lp, max_tokens)
    assert loss == pytest.approx((-1.0 - 1.2 + 0.8 + 1.1 + 0.9) / 5, abs=1e-12)
    assert m["clip_fraction"] == pytest.approx(2 / 5)
    assert m["ratio_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 1.1 + 0.9) / 5)
    assert m["policy_loss"] == pytest.approx(loss)
    assert "kl" not in m and "gen_kl_error" not in m
    # unclipped tokens: d/dlogp (-r A / 5) = -r A / 5; clipped tokens: 0; first token: 0
    assert grads[0].tolist() == pytest.approx([0.0, -1.0 / 5, 0.0])
    assert grads[1].tolist() == pytest.approx([0.0, 0.0, 1.1 / 5, 0.9 / 5])


def test_grpo_sequence_level_hand_value():
    batch, lp = _example()
    loss, _, _ = _run(GRPO(C.GRPOConfig(loss_level="sequence")), batch, lp, 4)
    assert loss == pytest.approx(((-1.0 - 1.2) / 2 + (0.8 + 1.1 + 0.9) / 3) / 2, abs=1e-12)


@pytest.mark.parametrize("estimator,value", [("k1", math.log(2)), ("k2", 0.5 * math.log(2) ** 2), ("k3", 0.5 - 1 + math.log(2))])
def test_grpo_kl_estimators_hand_value(estimator, value):
    batch, lp = _example(ref_log_ratio=math.log(0.5))  # p_ref / p = 0.5 on every valid token
    alg = GRPO(C.GRPOConfig(kl_coef=0.1, kl_estimator=estimator))
    assert alg.uses_reference
    loss, m, _ = _run(alg, batch, lp)
    assert m["kl"] == pytest.approx(value, abs=1e-12)
    assert loss == pytest.approx(0.6 / 5 + 0.1 * value, abs=1e-12)


def test_grpo_without_kl_needs_no_reference():
    assert not GRPO(C.GRPOConfig(kl_coef=0.0)).uses_reference
    assert GRPO().uses_old_logprobs and not GRPO(C.GRPOConfig(use_old_logprobs=False)).uses_old_logprobs


def test_truncated_importance_sampling_hand_value():
    # p_old / p_gen per valid token: A [1, 3], B [1, 0.5, 1]; cap 2 -> weights [1, 2], [1, 0.5, 1]
    log_w = {0: [0.0, math.log(3)], 1: [0.0, math.log(0.5), 0.0]}
    batch, lp = _example(gen_log_w=log_w)
    loss, m, _ = _run(GRPO(C.GRPOConfig(gen_is_cap=2.0)), batch, lp, 4)
    assert loss == pytest.approx((-1.0 - 1.2 * 2 + 0.8 + 1.1 * 0.5 + 0.9) / 5, abs=1e-12)
    assert m["is_truncated_fraction"] == pytest.approx(1 / 5)
    assert m["gen_kl_error"] == pytest.approx((math.log(3) + math.log(2)) / 5)
    # without a cap: metrics only, the loss is unweighted
    loss, m, _ = _run(GRPO(), batch, lp)
    assert loss == pytest.approx(0.6 / 5) and "is_truncated_fraction" not in m
    assert m["gen_kl_error"] == pytest.approx((math.log(3) + math.log(2)) / 5)
    assert m["rollout_ratio_max"] == pytest.approx(3.0)  # the maximum over micro-batches, not their sum


# Generator ratios p_old / p_gen per valid token: A [1, 3], B [1, 0.5, 1]; sequence ratios 3 and 0.5.
# PPO token losses (TOKEN_LOSSES): A [-1.0, -1.2], B [0.8, 1.1, 0.9]; 5 valid tokens, 2 sequences.
CORRECTION_CASES = [
    # (preset and its keys, loss, metrics it must report)
    ({"preset": "token_tis", "cap": 2.0}, (-1.0 - 1.2 * 2 + 0.8 + 1.1 * 0.5 + 0.9) / 5, {"is_truncated_fraction": 1 / 5}),
    ({"preset": "seq_tis", "cap": 2.0}, (2 * (-1.0 - 1.2) + 0.5 * (0.8 + 1.1 + 0.9)) / 5,
     {"rollout_truncated_seq_fraction": 1 / 2, "rollout_seq_ratio_max": 3.0}),
    ({"preset": "token_mis", "low": 0.5, "high": 2.0}, (-1.0 + 0.8 + 1.1 * 0.5 + 0.9) / 5,
     {"rollout_masked_token_fraction": 1 / 5, "rollout_masked_seq_fraction": 1 / 2}),
    ({"preset": "seq_mis", "low": 0.5, "high": 2.0}, 0.5 * (0.8 + 1.1 + 0.9) / 5,
     {"rollout_masked_token_fraction": 2 / 5, "rollout_masked_seq_fraction": 1 / 2}),
    ({"preset": "icepop", "icepop_k": 2.5}, (-1.0 + 0.8 + 1.1 * 0.5 + 0.9) / 5,  # band [0.4, 2.5]
     {"rollout_masked_token_fraction": 1 / 5}),
    ({"preset": "icepop", "icepop_k": 4.0}, (-1.0 - 1.2 * 3 + 0.8 + 1.1 * 0.5 + 0.9) / 5, {"rollout_masked_token_fraction": 0.0}),
    ({"preset": "none"}, 0.6 / 5, {}),
]


@pytest.mark.parametrize("max_tokens", [4, 64])
@pytest.mark.parametrize(("keys", "want_loss", "want_metrics"), CORRECTION_CASES)
def test_rollout_correction_presets_hand_values(keys, want_loss, want_metrics, max_tokens):
    """Each preset's loss on the hand example, one micro-batch per sequence (4) or one for both (64)."""
    config = C.GRPOConfig(rollout_correction=C.RolloutCorrectionConfig(**keys))
    batch, lp = _example(gen_log_w={0: [0.0, math.log(3)], 1: [0.0, math.log(0.5), 0.0]})
    loss, m, grads = _run(GRPO(config), batch, lp, max_tokens)
    assert loss == pytest.approx(want_loss, abs=1e-12)
    for name, value in want_metrics.items():
        assert m[name] == pytest.approx(value, abs=1e-12), name
    k3 = (3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5))  # r - 1 - log r per token
    assert m["rollout_kl_k3"] == pytest.approx(k3 / 5, abs=1e-12) and m["rollout_ratio_max"] == pytest.approx(3.0)
    assert all(g is not None for g in grads)


def test_rollout_correction_keys():
    with pytest.raises(ValueError, match="low .* must be below high"):
        C.RolloutCorrectionConfig(low=2.0, high=1.0)
    with pytest.raises(ValueError, match="icepop_k must be > 1"):
        C.RolloutCorrectionConfig(icepop_k=0.5)
    with pytest.raises(ValueError, match="gen_is_cap .* and rollout_correction.preset .* are both set"):
        C.GRPOConfig(gen_is_cap=2.0, rollout_correction=C.RolloutCorrectionConfig(preset="seq_tis"))
    assert C.GRPOConfig(gen_is_cap=1.5).correction == C.RolloutCorrectionConfig(preset="token_tis", cap=1.5)
    assert GRPO(C.GRPOConfig(rollout_correction=C.RolloutCorrectionConfig(preset="icepop"))).required_fields()["gen_logprobs"]


def test_dual_clip_hand_value():
    ratio = torch.tensor([4.0, 4.0, 0.1], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    loss, clipped, dual = clipped_surrogate(ratio, adv, 0.2, 0.2, 3.0)
    # A<0, r=4: max(4, 1.2) = 4 -> dual clip at 3; A>0, r=4: max(-4, -1.2) = -1.2; A<0, r=0.1: 0.8
    assert loss.tolist() == pytest.approx([3.0, -1.2, 0.8])
    assert dual.tolist() == [True, False, False] and clipped.tolist() == [False, True, True]


def test_gspo_sequence_ratio_hand_value_and_gradient():
    batch, lp = _example()
    loss, m, _ = _run(GSPO(C.GSPOConfig(ratio_clip_min=0.2, ratio_clip_max=0.2)), batch, lp, 4)
    s_a, s_b = math.sqrt(1.0 * 1.5), (0.5 * 1.1 * 0.9) ** (1 / 3)  # 1.2247 (clipped to 1.2), 0.7910
    assert loss == pytest.approx((max(-s_a, -1.2) + max(s_b, 0.8)) / 2, abs=1e-12)
    # unclipped: loss = (-s_a + s_b) / 2, d s_i / d logp_t = s_i / |y_i|
    loss, _, grads = _run(GSPO(C.GSPOConfig(ratio_clip_min=0.9, ratio_clip_max=9.0)), batch, lp)
    assert loss == pytest.approx((-s_a + s_b) / 2, abs=1e-12)
    assert grads[0].tolist() == pytest.approx([0.0, -s_a / 2 / 2, -s_a / 2 / 2])
    assert grads[1].tolist() == pytest.approx([0.0] + [s_b / 3 / 2] * 3)


def test_dr_grpo_constant_normalizer_hand_value():
    batch, lp = _example()
    alg = DrGRPO(C.DrGRPOConfig(normalizer_length=4))
    loss, _, _ = _run(alg, batch, lp, 4)
    assert alg.loss_level == "sequence"
    assert loss == pytest.approx(0.6 / (2 * 4), abs=1e-12)


def test_sft_masked_nll_hand_value():
    batch, lp = _example()
    alg = SFT()
    assert not alg.uses_reference and not alg.uses_old_logprobs
    loss, m, grads = _run(alg, batch, lp)
    expected = -(sum(float(x.sum()) for x in lp)) / 5
    assert loss == pytest.approx(expected) and m["nll"] == pytest.approx(expected)
    assert grads[1].tolist() == pytest.approx([0.0, -0.2, -0.2, -0.2])


def test_on_policy_ratio_is_one_with_reinforce_gradient():
    batch, lp = _example()
    loss, m, grads = _run(GRPO(C.GRPOConfig(use_old_logprobs=False)), batch, lp)
    assert loss == pytest.approx((-1 - 1 + 1 + 1 + 1) / 5) and m["ratio_mean"] == pytest.approx(1.0)
    assert grads[0].tolist() == pytest.approx([0.0, -0.2, -0.2])


@pytest.mark.parametrize("cls", [GRPO, DAPO, GSPO, DrGRPO, RLOO, ReinforcePP, SFT])
def test_empty_micro_batch_is_a_zero_loss_step(cls):
    """A data-parallel rank with fewer bins runs empty micro-batches (padding only)."""
    batch, _ = _example(ref_log_ratio=0.1, gen_log_w={0: [0.0, 0.0], 1: [0.0, 0.0, 0.0]})
    (mb,) = make_micro_batches(batch, 64, dp_rank=1, dp_size=2, pad_to_multiple=4)
    assert mb.num_seqs == 0 and mb.num_tokens == 4
    lp_T = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    loss, metrics = cls().loss(lp_T, mb, step_totals(batch))
    loss.backward()
    assert float(loss.detach()) == 0.0 and lp_T.grad.abs().sum() == 0
    assert metrics and all(v == 0.0 for v in metrics.values())


# ---- advantages ------------------------------------------------------------------------------
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
GROUPS = torch.tensor([0, 0, 0, 0, 7, 7, 7, 7])


def test_group_advantages_hand_values():
    a = 0.5 / math.sqrt(1 / 3)  # group 0: mean 0.5, unbiased std sqrt(1/3)
    assert GRPO().advantages(REWARDS, GROUPS).tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0])
    loo = GRPO(C.GRPOConfig(leave_one_out_baseline=True, normalize_std=False)).advantages(REWARDS, GROUPS)
    assert loo.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    assert RLOO().advantages(REWARDS, GROUPS).tolist() == pytest.approx(loo.tolist())
    assert DrGRPO().advantages(REWARDS, GROUPS).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_reinforce_pp_batch_normalization_hand_values():
    centered = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], dtype=torch.float64)
    std = math.sqrt(float((centered**2).sum()) / 7)  # batch mean is 0
    got = ReinforcePP().advantages(REWARDS, GROUPS)
    assert got.tolist() == pytest.approx((centered / std).tolist())
    raw = ReinforcePP(C.ReinforcePPConfig(group_baseline=False)).advantages(REWARDS, GROUPS)
    assert raw.tolist() == pytest.approx(((REWARDS - REWARDS.mean()) / REWARDS.std()).tolist())


def test_dapo_dynamic_sampling_overlong_shaping_and_filtering():
    cfg = C.DAPOConfig(max_response_length=10, overlong_buffer_length=4, overlong_penalty_factor=0.5, overlong_filtering=True)
    alg = DAPO(cfg)
    assert alg.max_refill_rounds == 3 and alg.config.ratio_clip_max == 0.28
    lengths = torch.tensor([5, 6, 8, 10, 12])
    shaped = alg.shape_rewards(torch.ones(5), lengths, torch.tensor([False] * 4 + [True]))
    # L_max - L_c = 6: excess [0, 0, 2, 4, 6] / 4 -> [0, 0, .5, 1, 1(capped)] * 0.5
    assert shaped.tolist() == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.5])
    truncated = torch.tensor([False, False, False, True, False, False, False, False])
    keep = alg.keep_trajectories(REWARDS, GROUPS, truncated)
    assert keep.tolist() == [True, True, True, False, False, False, False, False]
    assert DAPO(C.DAPOConfig(dynamic_sampling=False)).max_refill_rounds == 0
    assert GRPO().keep_trajectories(REWARDS, GROUPS, truncated).all()


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("cls", [GRPO, DAPO, GSPO, DrGRPO, RLOO, ReinforcePP, SFT])
def test_non_finite_rewards_are_errors(cls, bad):
    r = REWARDS.clone()
    r[5] = bad
    with pytest.raises(ValueError, match=r"rewards\[5\] is .*must be finite"):
        cls().advantages(r, GROUPS)
    with pytest.raises(ValueError, match=r"rewards\[5\]"):
        cls().keep_trajectories(r, GROUPS, torch.zeros(8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"rewards\[5\]"):
        cls().shape_rewards(r, torch.ones(8), torch.zeros(8, dtype=torch.bool))


def test_group_of_one_with_std_normalization_or_leave_one_out_is_an_error():
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 3])
    with pytest.raises(ValueError, match="group 3 has 1 trajectory.*std normalization"):
        GRPO().advantages(REWARDS, groups)
    with pytest.raises(ValueError, match="group 3 has 1 trajectory.*leave-one-out"):
        RLOO().advantages(REWARDS, groups)
    assert torch.isfinite(DrGRPO().advantages(REWARDS, groups)).all()  # a mean baseline is fine


def test_mismatched_shapes_are_errors():
    with pytest.raises(ValueError, match="group_ids has shape"):
        GRPO().advantages(REWARDS, GROUPS[:-1])
    with pytest.raises(ValueError, match="response_lengths has shape"):
        DAPO().shape_rewards(REWARDS, torch.ones(3), torch.zeros(8, dtype=torch.bool))
    batch, lp = _example()
    (mb,) = make_micro_batches(batch, 64)
    with pytest.raises(ValueError, match=r"logprobs_T has shape \(6,\), the micro-batch has 7 tokens"):
        GRPO().loss(torch.zeros(6), mb, step_totals(batch))
    mb.token_fields["old_logprobs"] = torch.zeros(5)
    with pytest.raises(ValueError, match="token field 'old_logprobs' has shape"):
        GRPO().loss(torch.zeros(7), mb, step_totals(batch))


def test_missing_fields_and_bad_advantages_are_errors():
    batch, lp = _example()
    totals = step_totals(batch)
    (mb,) = make_micro_batches(batch, 64)
    with pytest.raises(ValueError, match="'ref_logprobs' is missing.*kl_coef"):
        GRPO(C.GRPOConfig(kl_coef=0.1)).loss(torch.zeros(7), mb, totals)
    with pytest.raises(ValueError, match="'gen_logprobs' is missing.*gen_is_cap"):
        GRPO(C.GRPOConfig(gen_is_cap=2.0)).loss(torch.zeros(7), mb, totals)
    mb.token_fields["advantages"][5] = float("nan")
    with pytest.raises(ValueError, match=r"advantage of token 5 \(sequence 1\) is nan"):
        GRPO().loss(torch.zeros(7), mb, totals)
    del mb.token_fields["advantages"]
    with pytest.raises(ValueError, match="no 'advantages'"):
        GRPO().loss(torch.zeros(7), mb, totals)


def test_all_masked_responses_are_an_error():
    batch, _ = _example()
    batch.loss_mask = [torch.zeros_like(m) for m in batch.loss_mask]
    with pytest.raises(ValueError, match="all-zero loss_mask"):
        step_totals(batch)


def test_config_validation():
    with pytest.raises(ValueError, match="ratio_clip_c must be > 1"):
        C.GRPOConfig(ratio_clip_c=0.5)
    with pytest.raises(ValueError, match="needs max_response_length"):
        C.DAPOConfig(overlong_buffer_length=4)
    with pytest.raises(TypeError, match="needs a GRPOConfig"):
        GRPO(C.DAPOConfig())


def test_registered_and_built_through_plugins():
    from rlcore.loading.loader import build_config
    from rlcore.plugins import get_plugin_manager

    manager = get_plugin_manager()
    for name, cls in C.ALGORITHM_CONFIGS.items():
        cfg = build_config({"policy": {"model_name": "x"}, "algorithm": {"name": name}}, manager=manager)
        alg = manager.get("algorithm", name).build(cfg.section("algorithm"))
        assert isinstance(alg, Algorithm) and alg.name == name and isinstance(alg.config, cls)


def test_listing_algorithms_imports_no_torch(run_python):
    result = run_python("""
        import json, sys
        from rlcore.plugins import get_plugin_manager
        names = sorted(get_plugin_manager().registry["algorithm"])
        import rlcore.algorithms.config
        print(json.dumps({"names": names, "torch": "torch" in sys.modules}))
    """)
    assert result.returncode == 0, result.stderr
    out = __import__("json").loads(result.stdout.strip().splitlines()[-1])
    assert not out["torch"]
    assert set(out["names"]) >= {"grpo", "dapo", "gspo", "dr_grpo", "rloo", "reinforce_pp", "sft"}
