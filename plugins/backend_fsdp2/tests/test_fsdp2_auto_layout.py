"""``policy.dtensor_cfg.layout: auto``: the planner fills in what the section leaves out, keeps what it sets,
and the backend builds and trains with the result."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.interfaces import SequenceBatch


def _run(model_dir, **dtensor):
    from rlcore import build_config

    return build_config({"policy": {"model_name": str(model_dir), "precision": "float32",
                                    "dtensor_cfg": {"layout": "auto", **dtensor}},
                         "train": {"num_prompts_per_step": 2}, "grpo": {"num_generations_per_prompt": 2}})


@pytest.mark.parametrize("world", [2, 4, 8])
def test_auto_layout_is_a_valid_mesh(world):
    from rlcore.testing.tiny import tiny_config
    from rlcore_fsdp2.config import apply_auto_layout
    from rlcore_fsdp2.parallel_dims import ParallelDims

    hf = tiny_config("llama", hidden_size=256, num_heads=4, num_kv_heads=2)
    for keys in ({}, {"tensor_parallel_size": 2}):
        run = _run("/not/read", **keys)
        cfg = apply_auto_layout(run.section("policy.dtensor_cfg"), run, hf.to_dict(), world, "cpu", report=lambda _: None)
        dims = ParallelDims.from_config(cfg.tensor_parallel_size, cfg.context_parallel_size, world)
        dims.check_model(hf)
        assert not cfg.cpu_offload  # CUDA only: never chosen on CPU
        for key, value in keys.items():
            assert getattr(cfg, key) == value


def test_auto_layout_builds_and_trains(single_process_group, tiny_model_dir, capsys):
    from rlcore.algorithms.config import GRPOConfig
    from rlcore.algorithms.grpo import GRPO
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend

    run = _run(tiny_model_dir, activation_checkpointing=True)
    backend = FSDP2Backend(run, run.section("policy.dtensor_cfg"), WorldInfo())
    assert "layout: auto chose FSDP=1" in capsys.readouterr().out
    assert backend.cfg.activation_checkpointing is True  # set by the section: kept
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 100, (n,), generator=g) for n in (12, 7, 15, 9)]
    masks = [torch.cat([torch.zeros(3), torch.ones(len(x) - 3)]) for x in ids]
    batch = SequenceBatch(input_ids=ids, loss_mask=masks, token_fields={"gen_logprobs": [torch.zeros(len(x)) for x in ids]},
                          seq_fields={"advantages": torch.tensor([1.0, -0.5, 0.25, -1.0])})
    metrics = backend.train(batch, GRPO(GRPOConfig(use_old_logprobs=False)))
    assert math.isfinite(metrics["loss"])
