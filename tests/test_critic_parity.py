"""PPO's critic on both training backends against one single-process float64 reference.

Two gloo ranks (``_critic_worker.py``) build each backend's registered critic factory in several
layouts, from a one-label token-classification checkpoint with a trained-looking (non-zero) head:
fsdp2 over 2 data-parallel ranks, Megatron over 2 data-parallel ranks, TP=2 with sequence
parallelism, PP=2 and CP=2. Each gives the values of a batch, then one optimizer step on the
clipped value loss over packed micro-batches of 20 tokens. The reference is the Hugging Face model
in float64 with torch's AdamW: values (token-aligned, token t from row t-1), the loss, the
pre-clip gradient norm and every weight after the step must agree to fp32 accuracy. A fresh head
on a causal LM starts at zero (checked in one process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlcore.testing.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two launches of imports: ~1-4 min on 2 cores
WORKER = Path(__file__).with_name("_critic_worker.py")
TOL = 1e-5  # fp32 values (|v| ~ 1, a forward through the tiny Llama) vs the float64 reference's
LR_OF_STEP = 1e-3  # _critic_worker.LR
# Weights after one Adam step (eps 1e-6): Adam moves each weight by lr * g / (|g| + eps), so the fp32
# rounding d of a near-zero gradient entry moves that weight by up to lr * d / eps, a sizable fraction
# of lr: agreement within 5% of lr, while a wrong or missing update moves a weight by about lr.
WEIGHTS_TOL = 0.05 * LR_OF_STEP


def load_worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_critic_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def value_model(tiny_model_factory, tmp_path_factory):
    """A value checkpoint: the tiny Llama's body with a seeded random ``score`` head."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from rlcore.training.value_model import value_model_config

    causal = tiny_model_factory("llama", hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
    config = value_model_config(AutoConfig.from_pretrained(causal))
    model = AutoModelForTokenClassification.from_pretrained(causal, config=config, dtype=torch.float32)
    torch.manual_seed(5)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.3)
        model.score.bias.fill_(0.1)
    out = tmp_path_factory.mktemp("value-model")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def results(value_model, tmp_path_factory):
    import os

    from rlcore.utils import free_port

    out = tmp_path_factory.mktemp("critic-ranks")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    run_ranks(WORKER, [str(free_port()), str(value_model), str(out)], what="critic workers", timeout=420, env=env)
    return torch.load(out / "critic.pt", weights_only=False)


@pytest.fixture(scope="module")
def reference(value_model):
    """(values before, loss, grad norm, weights after, values after) of one float64 step in one process."""
    from transformers import AutoModelForTokenClassification

    from rlcore.algorithms.value_loss import ValueLoss
    from rlcore.data.packing import make_micro_batches, step_totals

    worker = load_worker()
    model = AutoModelForTokenClassification.from_pretrained(value_model, dtype=torch.float64)
    batch = worker.make_batch()

    with torch.no_grad():
        before = [values_of(model, ids) for ids in batch.input_ids]
    loss_fn, totals, total = ValueLoss(0.2), step_totals(batch), 0.0
    for mb in make_micro_batches(batch, worker.MB_TOKENS):
        parts = [values_of(model, batch.input_ids[i]) for i in mb.seq_ids]
        values_T = torch.nn.functional.pad(torch.cat(parts), (0, mb.num_padding))
        loss, _ = loss_fn.loss(values_T, mb.to("cpu"), totals)
        loss.backward()
        total += float(loss.detach())
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), worker.MAX_GRAD_NORM))
    torch.optim.AdamW(model.parameters(), lr=worker.LR, eps=worker.EPS, weight_decay=0.0).step()
    with torch.no_grad():
        after = [values_of(model, ids) for ids in batch.input_ids]
    return before, total, norm, {k: v.detach() for k, v in model.state_dict().items()}, after


def values_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Token-aligned values of one sequence: token t's value is the head on row t-1; token 0's is 0."""
    return torch.cat([torch.zeros(1, dtype=torch.float64), model(input_ids=ids[None]).logits[0, :-1, 0]])


def scenario(results, name):
    entry = results[name]
    if "error" in entry:
        pytest.fail(f"critic scenario {name} failed:\n{entry['error']}")
    return entry


def on_mask(values, batch):
    return [v[m > 0].double() for v, m in zip(values, batch.loss_mask)]


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["fsdp2_dp2", "megatron_dp2", "megatron_tp2_sp", "megatron_pp2", "megatron_cp2"])
def test_critic_values_and_step_match_the_float64_reference(results, reference, value_model, name):
    from safetensors.torch import load_file

    got = scenario(results, name)
    batch = load_worker().make_batch()
    before, loss, norm, weights, after = reference
    assert all(v.dtype == torch.float32 and float(v[0]) == 0.0 for v in got["values"])
    assert max_diff(on_mask(got["values"], batch), on_mask(before, batch)) < TOL
    metrics = got["metrics"]
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert 0.0 < metrics["value_clip_fraction"] < 1.0  # the clip binds on some tokens, not all
    assert metrics["num_micro_batches"] >= 2
    assert set(got["weights"]) == set(weights), f"{name}: exported names differ from the checkpoint's"
    initial = load_file(str(value_model / "model.safetensors"))
    moved = max(float((weights[k] - w0.double()).abs().max()) for k, w0 in initial.items())
    assert moved > 0.5 * LR_OF_STEP  # the step really moved the weights (Adam moves each by about lr)
    diff = max(float((got["weights"][k].double() - weights[k]).abs().max()) for k in weights)
    assert diff < WEIGHTS_TOL, f"{name}: weights after the step differ from the reference by {diff}"
    # Values after the step: the forward's rounding (TOL) plus the weights' differences. The whole step
    # (~lr on each of ~3e5 weights) changes the values by ~10, ~3e-2 per weight moved by lr, so even a
    # few weights off by WEIGHTS_TOL add ~1e-6 each; a wrong update changes them by order 1.
    assert max_diff(on_mask(got["values_after"], batch), on_mask(after, batch)) < 10 * TOL
