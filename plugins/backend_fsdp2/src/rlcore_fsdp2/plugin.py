"""Registers the ``fsdp2`` training backend (section ``policy.dtensor_cfg``).

Nothing heavy is imported here: the factory is a "module:attr" string resolved on first use,
so ``rlcore plugins`` lists this backend without importing torch.
"""

from __future__ import annotations

from rlcore import hookimpl
from rlcore_fsdp2.config import SECTION, DTensorConfig


@hookimpl
def rlcore_training_backends(register):
    register(
        "fsdp2",
        "rlcore_fsdp2.backend:build_backend",
        DTensorConfig,
        section=SECTION,
        precedence=0,  # megatron (precedence 10) wins when both sections are enabled
        devices=("cpu", "cuda"),
        parallelism=("dp", "tp", "sp"),
        packing=True,
        architectures=("llama", "qwen2", "qwen3", "qwen3_moe"),
        requires=("torch", "transformers"),
        critic="rlcore_fsdp2.critic:build_critic",  # PPO's value model on the same ranks (rlcore.interfaces.CriticHandle)
    )


@hookimpl
def rlcore_export_checkpoint(backend, checkpoint_dir, config, out_dir):
    if backend != "fsdp2":
        return None
    from rlcore_fsdp2.export import export_checkpoint

    return export_checkpoint(checkpoint_dir, config, out_dir)
