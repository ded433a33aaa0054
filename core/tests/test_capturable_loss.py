"""The :class:`rlcore.interfaces.CapturableLoss` contract, checked for every algorithm that declares it.

A backend that captures the loss in a CUDA graph (``policy.megatron_cfg.cuda_graph: micro_batch``)
replays it for other micro-batches of one shape: padded to a fixed token count, with dummy
sequences, and with the step totals as 0-d tensors. This machine cannot capture, so two things
stand in for it: a torch function mode that fails on every host read of a tensor value (what a
capture refuses, or worse, freezes), and ``rlcore.algorithms.base.capturing`` answering True (the
state a capture would put the loss in). On the padded micro-batch each declared loss must read no
tensor value on the host and give the loss, metrics and logprob gradient of the unpadded one.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.overrides import TorchFunctionMode

from rlcore.algorithms import config as C
from rlcore.interfaces import CapturableLoss, StepTotals
from rlcore.data.packing import MicroBatch, make_micro_batches, step_totals
from test_invariance import ALGORITHMS, build_algorithm, build_batch, build_model

CAPTURABLE = {**ALGORITHMS, "cispo": ("cispo", C.CISPOConfig(kl_coef=0.05)),
              "distillation": ("distillation", C.DistillationConfig())}
NOT_CAPTURABLE = {"dpo": C.DPOConfig(), "reward_model": C.RewardModelConfig()}
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.__index__, torch.Tensor.numpy, torch.nonzero, torch.Tensor.nonzero, torch.argwhere,
              torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique}


class NoHostReads(TorchFunctionMode):
    """Fails on every call that reads a tensor's value on the host or gives a data-dependent shape."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError(f"host read of a tensor value: {func.__name__}")
        if func is torch.Tensor.__getitem__ and any(torch.is_tensor(i) and i.dtype == torch.bool
                                                    for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            raise AssertionError("boolean-mask indexing (a data-dependent shape)")
        return func(*args, **(kwargs or {}))


def padded(mb: MicroBatch, extra_tokens: int, extra_seqs: int) -> MicroBatch:
    """``mb`` laid out as a graph's static buffers hold it: trailing padding tokens (mask 0,
    sequence index -1, fields 0) and zero-valued dummy sequences no token points at."""
    def pad(x, value=0):
        return torch.nn.functional.pad(x, (0, extra_tokens), value=value)

    return attrs.evolve(
        mb, input_ids_T=pad(mb.input_ids_T), position_ids_T=pad(mb.position_ids_T), seq_index_T=pad(mb.seq_index_T, -1),
        loss_mask_T=pad(mb.loss_mask_T), token_fields={k: pad(v) for k, v in mb.token_fields.items()},
        seq_fields={k: torch.cat([v, v.new_zeros((extra_seqs, *v.shape[1:]))]) for k, v in mb.seq_fields.items()},
        seq_ids=[*mb.seq_ids, *([-1] * extra_seqs)], num_padding=mb.num_padding + extra_tokens,
        logprob_rows_R=None)


@pytest.fixture(scope="module")
def batch():
    batch = build_batch(build_model())
    batch.token_fields["teacher_logprobs"] = [lp - 0.1 for lp in batch.token_fields["ref_logprobs"]]
    return batch


def run_loss(algorithm, mb: MicroBatch, totals: StepTotals, logprobs_T: torch.Tensor):
    leaf_T = logprobs_T.clone().requires_grad_(True)
    loss, metrics = algorithm.loss(leaf_T, mb, totals)
    loss.backward()
    return loss.detach(), {k: torch.as_tensor(v).detach() for k, v in metrics.items()}, leaf_T.grad


@pytest.mark.parametrize("key", sorted(CAPTURABLE))
def test_declared_losses_read_nothing_on_the_host_and_ignore_padding(batch, key, monkeypatch):
    name, cfg = CAPTURABLE[key]
    from rlcore.plugins import get_plugin_manager

    algorithm = get_plugin_manager().get("algorithm", name).build(cfg) if key not in ALGORITHMS else build_algorithm(key)
    assert isinstance(algorithm, CapturableLoss) and algorithm.capturable_loss
    mb = make_micro_batches(batch, 1000)[0]
    totals = step_totals(batch)
    g = torch.Generator().manual_seed(2)
    logprobs_T = -torch.rand(mb.num_tokens, generator=g, dtype=torch.float64) * 3
    want = run_loss(algorithm, mb, totals, logprobs_T)

    extra = 9
    graph_mb = padded(mb, extra, extra_seqs=5)
    device_totals = StepTotals(torch.tensor(float(totals.num_valid_tokens), dtype=torch.float64),
                               torch.tensor(float(totals.num_valid_seqs), dtype=torch.float64))
    monkeypatch.setattr("rlcore.algorithms.base.capturing", lambda: True)  # the state a CUDA capture puts the loss in
    with NoHostReads():
        got = run_loss(algorithm, graph_mb, device_totals, torch.nn.functional.pad(logprobs_T, (0, extra), value=-1.0))
    assert torch.allclose(got[0], want[0], rtol=1e-12, atol=1e-14)
    assert sorted(got[1]) == sorted(want[1])
    for k in want[1]:
        assert torch.allclose(got[1][k].double(), want[1][k].double(), rtol=1e-12, atol=1e-14), k
    assert torch.allclose(got[2][: mb.num_tokens], want[2], rtol=1e-12, atol=1e-14) and not got[2][mb.num_tokens:].any()


def test_losses_that_pair_sequences_on_the_host_do_not_declare_it():
    from rlcore.plugins import get_plugin_manager

    for name, cfg in NOT_CAPTURABLE.items():
        algorithm = get_plugin_manager().get("algorithm", name).build(cfg)
        assert not algorithm.capturable_loss, name
