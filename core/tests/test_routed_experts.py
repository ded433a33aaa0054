"""The generator's MoE routing on its way to the trainer (routing replay R3): a GenerationResult's
``routed_experts`` ([prompt + response - 1, MoE layers, top-k], the last token never fed) becomes
``SequenceBatch.routed_experts`` aligned with each sequence (cut where the sequence is cut, -1 where
nothing was reported), survives ``select`` but not the refit probe's selection, and a generator that
cannot report routing refuses the key."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlcore.config import ConfigError
from rlcore.config.hf_generation import HFGenerationConfig
from rlcore.generation.batching import Trajectory, to_sequence_batch
from rlcore.interfaces import GenerationResult, Placement, Sample


def trajectory(prompt: list[int], response: list[int], routed) -> Trajectory:
    result = GenerationResult(prompt_ids=prompt, response_ids=response, response_logprobs=[0.0] * len(response),
                              finish_reason="stop", routed_experts=routed)
    return Trajectory(sample=Sample(prompt="p"), group=0, result=result)


def test_routing_is_aligned_with_each_sequence_and_survives_select():
    rng = np.random.default_rng(0)
    full = rng.integers(0, 8, size=(3 + 4 - 1, 2, 2))  # 3 prompt + 4 response tokens, 2 MoE layers, top-2
    cut = rng.integers(0, 8, size=(2 + 6 - 1, 2, 2))
    trajs = [trajectory([1, 2, 3], [4, 5, 6, 7], full), trajectory([1, 2], [3, 4, 5, 6, 7, 8], cut),
             trajectory([1, 2], [3], None)]
    batch = to_sequence_batch(trajs, torch.zeros(3), max_len=6)
    first, second, third = batch.routed_experts
    # both cut to max_len 6 tokens: their routing is cut with them
    assert first.shape == (6, 2, 2) and torch.equal(first, torch.as_tensor(full[:6], dtype=torch.int16))
    assert second.shape == (6, 2, 2) and torch.equal(second, torch.as_tensor(cut[:6], dtype=torch.int16))
    assert batch.input_ids[0].numel() == batch.input_ids[1].numel() == 6
    assert third.shape == (3, 0, 0)  # reported nothing: no record for this sequence
    full_len = to_sequence_batch(trajs[:1], torch.zeros(1), max_len=64).routed_experts[0]
    assert full_len.shape == (7, 2, 2) and bool((full_len[6] == -1).all())  # the last token was never fed
    picked = batch.select([1])
    assert len(picked.routed_experts) == 1 and torch.equal(picked.routed_experts[0], second)
    assert to_sequence_batch(trajs[2:], torch.zeros(1), max_len=6).routed_experts is None


def test_the_refit_probe_leaves_the_routing_behind():
    # The generator scores the probe after the refit with its own router at the new weights; routing recorded at
    # the old ones would make the trainer replay another network's choice (seventeenth GPU session: the probe's
    # gap with R3 fell with the training pass's, 9.6e-3 to 5.2e-3, because it replayed too).
    from rlcore.controller.refit_probe import refit_probe_sequences

    batch = to_sequence_batch([trajectory([1, 2, 3], [4, 5, 6, 7], np.zeros((3 + 4 - 1, 2, 2))),
                               trajectory([1, 2], [3, 4], np.ones((2 + 2 - 1, 2, 2)))],
                              torch.tensor([1.0, 0.0]), max_len=64)
    assert batch.routed_experts is not None
    probe = refit_probe_sequences(batch, 1)
    assert probe.routed_experts is None
    assert len(probe) == 1 and torch.equal(probe.input_ids[0], batch.input_ids[0])
    assert torch.equal(probe.loss_mask[0], batch.loss_mask[0])
    assert len(refit_probe_sequences(batch, 8)) == 2


def test_malformed_routing_names_its_shape():
    with pytest.raises(ValueError, match=r"\[tokens, MoE layers, top-k\], got shape \(6, 2\)"):
        to_sequence_batch([trajectory([1, 2, 3], [4, 5, 6, 7], np.zeros((6, 2)))], torch.zeros(1), max_len=8)


def test_the_hf_generator_refuses_to_report_routing():
    from rlcore.config import RunConfig
    from rlcore.config.schema import PolicyConfig
    from rlcore.generation.hf_generator import build

    with pytest.raises(ConfigError, match=r"policy\.generation\.return_routed_experts.*does not report MoE routing"):
        build(RunConfig(policy=PolicyConfig(model_name="unused")), HFGenerationConfig(return_routed_experts=True), Placement())
