"""The validated parallel layout (dp_shard x cp x tp) and the device mesh built from it."""

from __future__ import annotations

from typing import Any

import attrs

from rlcore.config.structure import ConfigError
from rlcore_fsdp2.config import SECTION

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_vl", "llava")
VISION_LANGUAGE = ("qwen2_5_vl", "qwen3_vl", "llava")  # trained with tensor_parallel_size 1 only


@attrs.frozen
class ParallelDims:
    """How the world's ranks split: ``dp_shard * cp * tp == world_size``.

    Mesh dims are ordered ``(dp_shard, cp, tp)`` so that tensor-parallel peers are neighbouring
    ranks (one node, fastest links), as in torchtitan.
    """

    dp_shard: int
    cp: int
    tp: int
    world_size: int

    def __attrs_post_init__(self) -> None:
        for name in ("dp_shard", "cp", "tp", "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{SECTION}", f"parallel size {name}={getattr(self, name)} must be >= 1")
        if self.dp_shard * self.cp * self.tp != self.world_size:
            raise ConfigError(
                f"{SECTION}.tensor_parallel_size",
                f"data-parallel ({self.dp_shard}) x context_parallel_size ({self.cp}) x tensor_parallel_size "
                f"({self.tp}) = {self.dp_shard * self.cp * self.tp}, but the world has {self.world_size} ranks; "
                "the product must equal the world size",
            )

    @classmethod
    def from_config(cls, tp: int, cp: int, world_size: int) -> ParallelDims:
        """Data parallelism takes whatever tensor and context parallelism leave."""
        if world_size % (tp * cp):
            raise ConfigError(
                f"{SECTION}.tensor_parallel_size",
                f"tensor_parallel_size ({tp}) x context_parallel_size ({cp}) = {tp * cp} does not divide the world "
                f"size {world_size}; data-parallel x context x tensor parallel must equal the world size",
            )
        return cls(dp_shard=world_size // (tp * cp), cp=cp, tp=tp, world_size=world_size)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def build_mesh(self, device_type: str) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp_shard, self.cp, self.tp), mesh_dim_names=("dp_shard", "cp", "tp"))

    def check_model(self, hf_config: Any) -> None:
        """The architecture is supported and its head/feature counts split over ``tp`` ranks."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture: model_type {model_type!r} ({getattr(hf_config, 'architectures', None)}); "
                f"the fsdp2 backend supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.tp == 1:
            return
        if model_type in VISION_LANGUAGE:
            raise ConfigError(f"{SECTION}.tensor_parallel_size", f"vision-language models ({model_type}) train with "
                              "tensor_parallel_size 1 on the fsdp2 backend (no tensor-parallel plan covers the vision tower)")
        counts = {
            "num_attention_heads": hf_config.num_attention_heads,
            "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            "intermediate_size": hf_config.intermediate_size,
        }
        for name, value in counts.items():
            if value % self.tp:
                raise ConfigError(
                    f"{SECTION}.tensor_parallel_size",
                    f"{self.tp} does not divide the model's {name} ({value}); choose a tensor_parallel_size that does",
                )
