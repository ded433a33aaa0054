"""Shared by the tests and the 2-rank worker: the run config and batch they train on, built
through rlcore's public entry points (``rlcore.build_config``, the plugin manager)."""

from __future__ import annotations

import rlcore
from rlcore.plugins import get_plugin_manager


def run_config(model_dir: str, **policy):
    # Adam's large eps keeps an update ~linear in the gradient, so a gradient off by a factor
    # (an average over ranks instead of a sum) changes the weights visibly.
    return rlcore.build_config({"policy": {
        "model_name": str(model_dir), "precision": "float32", "max_grad_norm": 10.0,
        "optimizer": {"lr": 1e-2, "eps": 1e-2, "weight_decay": 0.0},
        "sequence_packing": {"train_mb_tokens": 24, "logprob_mb_tokens": 24},
        "dtensor_cfg": {"enabled": False}, "ddp_cfg": {"enabled": True}, **policy}})


def build(config, world):
    reg = get_plugin_manager().get("training_backend", "ddp")
    return reg.build(config, config.section(reg.section), world)


def make_batch(n: int = 6, seed: int = 0):
    """Sequences of random tokens, the first 3 a masked prompt, with advantages for a GRPO step."""
    import torch

    from rlcore.interfaces import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 100, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g) for _ in range(n)]
    masks = [torch.cat([torch.zeros(3), torch.ones(len(x) - 3)]) for x in ids]
    return SequenceBatch(input_ids=ids, loss_mask=masks, seq_fields={"advantages": torch.linspace(1.0, -1.0, n)})


def grpo():
    reg = get_plugin_manager().get("algorithm", "grpo")
    return reg.build(reg.config_cls())
