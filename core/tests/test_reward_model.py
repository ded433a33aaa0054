"""The reward model's Bradley-Terry loss against hand-computed pairs, the scalar head's pooling,
and the registry listing the new families without importing torch."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlcore.algorithms import config as C
from rlcore.algorithms.reward_model import RewardModel


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_bradley_terry_hand_value_and_gradient():
    chosen = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.0, 0.5], dtype=torch.float64, requires_grad=True)
    loss, m = RewardModel(C.RewardModelConfig(center_coef=0.1)).pair_loss(chosen, rejected)
    bt = (-math.log(_sig(1.0)) - math.log(_sig(-0.5))) / 2
    assert m["bt_loss"] == pytest.approx(bt) and m["center_loss"] == pytest.approx((1.0 + 0.25) / 2)
    assert float(loss) == pytest.approx(bt + 0.1 * 0.625)
    assert m["accuracy"] == 0.5 and m["reward_margin"] == pytest.approx(0.25)
    loss.backward()
    # d/d r_c = -sigmoid(-margin) / P + 0.1 * 2 (r_c + r_r) / P
    assert chosen.grad.tolist() == pytest.approx([-_sig(-1.0) / 2 + 0.1, -_sig(0.5) / 2 + 0.05])
    assert rejected.grad.tolist() == pytest.approx([_sig(-1.0) / 2 + 0.1, _sig(0.5) / 2 + 0.05])
    with pytest.raises(ValueError, match="must both be \\[P\\]"):
        RewardModel().pair_loss(torch.zeros(2), torch.zeros(3))
    with pytest.raises(TypeError, match="not on token logprobs"):
        RewardModel().loss(None, None, None)


def test_scalar_head_pools_each_sequences_last_token(tiny_model_dir):
    from rlcore.reward_model.scorer import RewardScorer

    scorer = RewardScorer(str(tiny_model_dir), device="cpu")
    seqs = [[3, 10, 11, 12, 13, 4], [3, 20, 21], [3, 30, 31, 32]]
    with torch.no_grad():
        together = scorer.scores(seqs)
        alone = torch.cat([scorer.scores([s]) for s in seqs])
    assert together.shape == (3,) and torch.allclose(together, alone, atol=1e-5)
    assert len(set(together.tolist())) == 3
    with pytest.raises(ValueError, match="contains the pad token id 0"):
        scorer.scores([[3, 0, 5]])


def test_plugins_list_the_post_training_families_without_torch(run_python):
    result = run_python("""
        import json, sys
        from rlcore.plugins import get_plugin_manager
        r = get_plugin_manager().registry
        print(json.dumps({"algorithms": sorted(r["algorithm"]), "environments": sorted(r["environment"]),
                          "datasets": sorted(r["dataset"]), "torch": "torch" in sys.modules}))
    """)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"dpo", "reward_model", "distillation", "cispo"} <= set(out["algorithms"])
    assert "reward_model" in out["environments"] and "preference" in out["datasets"] and not out["torch"]
