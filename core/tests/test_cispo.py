"""CISPO against a hand-computed batch (the example of test_algorithms.py) and its config errors."""

from __future__ import annotations

import pytest

from rlcore.algorithms import config as C
from rlcore.algorithms.cispo import CISPO
from rlcore.algorithms.grpo import GRPO

from test_algorithms import _example, _run


@pytest.mark.parametrize("max_tokens", [64, 4])  # one micro-batch, or one per sequence
def test_cispo_hand_value_and_gradient(max_tokens):
    # ratios A: [1.0, 1.5] (A=+1), B: [0.5, 1.1, 0.9] (A=-1); weights clip(r, 0, 1.28):
    # A: [1.0, 1.28], B: [0.5, 1.1, 0.9]; token losses -w A: [-1.0, -1.28], [0.5, 1.1, 0.9]
    batch, lp = _example()
    loss, m, grads = _run(CISPO(C.CISPOConfig()), batch, lp, max_tokens)
    assert loss == pytest.approx((-1.0 - 1.28 + 0.5 + 1.1 + 0.9) / 5, abs=1e-12)
    assert m["policy_loss"] == pytest.approx(loss) and m["clip_fraction"] == pytest.approx(1 / 5)
    # d loss / d log p_t = -w_t A_t / N_tokens: the truncated token (r=1.5) keeps its gradient
    assert grads[0].tolist() == pytest.approx([0.0, -1.0 / 5, -1.28 / 5])
    assert grads[1].tolist() == pytest.approx([0.0, 0.5 / 5, 1.1 / 5, 0.9 / 5])
    _, _, grpo_grads = _run(GRPO(C.GRPOConfig()), batch, lp, max_tokens)
    assert grpo_grads[0][2] == 0.0 and grpo_grads[1][1] == 0.0  # where PPO's clip drops the token


def test_cispo_lower_bound_and_sequence_level():
    batch, lp = _example()
    loss, _, grads = _run(CISPO(C.CISPOConfig(ratio_clip_min=0.2, loss_level="sequence")), batch, lp)
    # B's r=0.5 weight is raised to 0.8; sequence means: A (-1 - 1.28) / 2, B (0.8 + 1.1 + 0.9) / 3
    assert loss == pytest.approx(((-1.0 - 1.28) / 2 + (0.8 + 1.1 + 0.9) / 3) / 2, abs=1e-12)
    assert grads[1].tolist() == pytest.approx([0.0, 0.8 / 6, 1.1 / 6, 0.9 / 6])


def test_cispo_config_errors_name_the_key():
    with pytest.raises(ValueError, match="ratio_clip_min must be in \\[0, 1\\]"):
        C.CISPOConfig(ratio_clip_min=1.5)
    with pytest.raises(ValueError, match="ratio_clip_c .* has no meaning for cispo"):
        C.CISPOConfig(ratio_clip_c=3.0)
