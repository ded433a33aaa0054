"""``rlcore export`` of an fsdp2 checkpoint: its model part, resharded by DCP into one CPU process,
written by the backend's own Hugging Face export (the one a run's end uses)."""

from __future__ import annotations

from pathlib import Path

import attrs

from rlcore.config import RunConfig
from rlcore.interfaces import Placement, WorldInfo
from rlcore_fsdp2.config import SECTION


def export_checkpoint(checkpoint_dir: str | Path, config: RunConfig, out_dir: str | Path) -> Path:
    from transformers import AutoConfig

    from rlcore.runtime import init_distributed
    from rlcore.utils import free_port
    from rlcore_fsdp2 import checkpoint
    from rlcore_fsdp2.backend import FSDP2Backend

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / checkpoint.META_FILE).is_file() and not (checkpoint_dir / ".metadata").is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not an rlcore-fsdp2 checkpoint (no {checkpoint.META_FILE} or .metadata)")
    init_distributed(0, 1, free_port(), "cpu")
    # One rank holds the whole model: the saved layout's TP and offload settings do not apply here.
    cfg = attrs.evolve(config.section(SECTION), tensor_parallel_size=1, sequence_parallel=False, cpu_offload=False,
                       compile=False, custom_parallel_plan=None)
    hf_config = AutoConfig.from_pretrained(config.policy.model_name)
    backend = FSDP2Backend(config, cfg, WorldInfo(0, 1, 0, "cpu", Placement()), hf_config=hf_config)  # weights come next
    checkpoint.load_model(checkpoint_dir, backend.model, hf_config)
    backend.export_hf(str(out_dir))
    backend.shutdown()
    return Path(out_dir)
