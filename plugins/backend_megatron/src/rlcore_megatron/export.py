"""``rlcore export`` of a Megatron checkpoint: a one-process (TP=PP=CP=EP=1) model on the CPU
reads the checkpoint's model part, which ``dist_checkpointing`` reshards from the layout it was
saved with, and the backend's own Hugging Face export (the one a run's end uses) writes it."""

from __future__ import annotations

from pathlib import Path

import attrs

from rlcore.config import RunConfig
from rlcore.interfaces import Placement, WorldInfo
from rlcore_megatron.config import SECTION


def export_checkpoint(checkpoint_dir: str | Path, config: RunConfig, out_dir: str | Path) -> Path:
    from transformers import AutoConfig

    from rlcore.runtime import init_distributed
    from rlcore.utils import free_port
    from rlcore_megatron import checkpoint, cpu_shims
    from rlcore_megatron.backend import MegatronBackend

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "megatron").is_dir():
        raise FileNotFoundError(f"{checkpoint_dir} is not an rlcore-megatron checkpoint (no megatron/ directory)")
    init_distributed(0, 1, free_port(), "cpu")
    cfg = attrs.evolve(config.section(SECTION), tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                       context_parallel_size=1, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                       sequence_parallel=False, num_layers_in_first_pipeline_stage=None,
                       num_layers_in_last_pipeline_stage=None)
    hf_config = AutoConfig.from_pretrained(config.policy.model_name)
    world = WorldInfo(0, 1, 0, "cpu", Placement())
    # Random init, the checkpoint's weights come next; a LoRA checkpoint holds the adapters alone: the base is loaded.
    backend = MegatronBackend(config, cfg, world, hf_config=None if config.policy.lora.enabled else hf_config)
    with cpu_shims.active():
        checkpoint.load_model(backend, str(checkpoint_dir))
    backend.export_hf(str(out_dir))
    backend.shutdown()
    return Path(out_dir)
