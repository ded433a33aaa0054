"""Registers the ``megatron`` training backend (section ``policy.megatron_cfg``).

Nothing heavy is imported here: the factory is a "module:attr" string resolved on first use.
"""

from __future__ import annotations

from rlcore import hookimpl
from rlcore_megatron.config import SECTION, MegatronConfig


@hookimpl
def rlcore_training_backends(register):
    register(
        "megatron",
        "rlcore_megatron.backend:build_backend",
        MegatronConfig,
        section=SECTION,
        precedence=10,  # wins over fsdp2 when both sections are enabled
        devices=("cpu", "cuda"),
        parallelism=("dp", "tp", "pp", "cp", "ep", "etp", "sp"),
        packing=True,
        architectures=("llama", "qwen2", "qwen3", "qwen3_moe"),
        requires=("megatron.core",),
        critic="rlcore_megatron.critic:build_critic",  # PPO's value model on the same ranks (rlcore.interfaces.CriticHandle)
    )


@hookimpl
def rlcore_export_checkpoint(backend, checkpoint_dir, config, out_dir):
    if backend != "megatron":
        return None
    from rlcore_megatron.export import export_checkpoint

    return export_checkpoint(checkpoint_dir, config, out_dir)
