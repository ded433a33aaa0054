"""On-policy distillation's loss against hand-computed values (the example of test_algorithms.py
with a teacher), its config errors, and the teacher scorer against a plain forward pass."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algorithms import config as C
from rlcore.algorithms.distillation import Distillation

from test_algorithms import _example, _run

DELTA = {0: [0.5, -0.2], 1: [0.1, 0.3, -0.4]}  # log q_teacher - log p_train on each valid token


def _with_teacher(on_old: bool):
    batch, lp = _example()
    base = batch.token_fields["old_logprobs"] if on_old else lp
    batch.token_fields["teacher_logprobs"] = [b + torch.tensor([0.0] + DELTA[i], dtype=torch.float64)
                                              for i, b in enumerate(base)]
    return batch, lp


def test_on_policy_distillation_hand_value_and_gradient():
    batch, lp = _with_teacher(on_old=False)
    loss, m, grads = _run(Distillation(C.DistillationConfig(teacher_model="t")), batch, lp, 4)
    # r = 1, A_t = log q - log p: loss = mean_t(-A_t), the k1 reverse KL; d loss / d log p_t = -A_t / 5
    assert loss == pytest.approx(-(0.5 - 0.2 + 0.1 + 0.3 - 0.4) / 5, abs=1e-12)
    assert m["reverse_kl"] == pytest.approx(loss) and m["ratio_mean"] == pytest.approx(1.0)
    assert grads[0].tolist() == pytest.approx([0.0, -0.5 / 5, 0.2 / 5])
    assert grads[1].tolist() == pytest.approx([0.0, -0.1 / 5, -0.3 / 5, 0.4 / 5])


def test_distillation_against_old_logprobs_is_clipped_like_grpo():
    batch, lp = _with_teacher(on_old=True)
    alg = Distillation(C.DistillationConfig(teacher_model="t", use_old_logprobs=True))
    loss, m, _ = _run(alg, batch, lp)
    # max(-r A, -clip(r, 0.8, 1.2) A) with r A: [1.0 .5, 1.5 -.2], B: [.5 .1, 1.1 .3, .9 -.4]
    assert loss == pytest.approx((-0.5 + 0.3 - 0.05 - 0.33 + 0.36) / 5, abs=1e-12)
    assert m["reverse_kl"] == pytest.approx(-(0.5 - 0.2 + 0.1 + 0.3 - 0.4) / 5)


def test_distillation_needs_teacher_logprobs_and_a_teacher():
    batch, lp = _example()
    with pytest.raises(ValueError, match="'teacher_logprobs' is missing .the teacher scores the rollouts"):
        _run(Distillation(C.DistillationConfig(teacher_model="t")), batch, lp)
    from rlcore.config import ConfigError
    from rlcore.generation.teacher import build_teacher

    with pytest.raises(ConfigError, match="'algorithm.teacher_model': distillation needs a teacher"):
        build_teacher(C.DistillationConfig())
    with pytest.raises(ConfigError, match="'algorithm.teacher_model': '/no/such' is not a local Hugging Face model"):
        build_teacher(C.DistillationConfig(teacher_model="/no/such"))


def test_teacher_logprobs_match_a_plain_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rlcore.interfaces import SequenceBatch
    from rlcore.generation.teacher import HFTeacher

    teacher = HFTeacher(str(tiny_model_dir), device="cpu", batch_size=2)
    seqs = [torch.tensor([3, 10, 11, 12, 13]), torch.tensor([3, 20, 21]), torch.tensor([3, 30, 31, 32])]
    out = teacher.logprobs(SequenceBatch(input_ids=seqs, loss_mask=[torch.ones(len(s)) for s in seqs]))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for seq, got in zip(seqs, out):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=seq[None]).logits[0].float(), -1)
        want = [0.0] + [float(logp[t - 1, seq[t]]) for t in range(1, len(seq))]
        assert got.tolist() == pytest.approx(want, abs=1e-5) and not math.isnan(float(got.sum()))
