"""Skipping the old-logprob pass (one optimizer step per batch) changes nothing: in float64 the
step's loss, metrics and updated weights equal those of a step that ran the pass, to the float32
rounding of the pass's output (``TrainingBackend.logprobs`` returns float32: ~1e-8 relative)."""

from __future__ import annotations

import pytest
import torch

from rlcore.interfaces import SequenceBatch


def _backend(model_dir):
    from rlcore.config.schema import OptimizerConfig, PolicyConfig, RunConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig

    cfg = DTensorConfig()
    policy = PolicyConfig(model_name=str(model_dir), precision="float64", optimizer=OptimizerConfig(lr=1e-2, eps=1e-2))
    return FSDP2Backend(RunConfig(policy=policy, sections={SECTION: cfg}), cfg, WorldInfo())


def test_skipped_pass_gives_the_same_step_in_float64(single_process_group, tiny_model_dir):
    from rlcore.algorithms.config import GRPOConfig
    from rlcore.algorithms.grpo import GRPO

    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 100, (n,), generator=g) for n in (12, 7, 15, 9)]
    masks = [torch.cat([torch.zeros(3), torch.ones(len(x) - 3)]) for x in ids]
    gen = [torch.cat([torch.zeros(1), -torch.rand(len(x) - 1, generator=g) * 5]) for x in ids]
    steps = []
    for use_old in (True, False):
        batch = SequenceBatch(input_ids=ids, loss_mask=masks, token_fields={"gen_logprobs": gen},
                              seq_fields={"advantages": torch.tensor([1.0, -0.5, 0.25, -1.0])})
        backend = _backend(tiny_model_dir)
        if use_old:
            batch.token_fields["old_logprobs"] = backend.logprobs(batch)
        algorithm = GRPO(GRPOConfig(use_old_logprobs=use_old, gen_is_cap=2.0, ratio_clip_min=0.01, ratio_clip_max=0.01))
        metrics = backend.train(batch, algorithm)
        weights = {n: t.clone() for chunk in backend.export_weights() for n, t in chunk}
        steps.append((metrics, weights))
        backend.shutdown()
    (with_pass, weights_a), (without_pass, weights_b) = steps
    assert with_pass.keys() == without_pass.keys() and with_pass["grad_norm"] > 0
    for key in with_pass:
        if key != "train_seconds":
            assert without_pass[key] == pytest.approx(with_pass[key], rel=1e-6, abs=1e-9), key
    for name, tensor in weights_a.items():
        torch.testing.assert_close(weights_b[name], tensor, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")
