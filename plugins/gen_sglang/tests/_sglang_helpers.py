"""What the tests build their generators with."""

from __future__ import annotations


def build_generator(manager, model_dir, device: str = "cuda", **generation):
    """An ``sglang`` generator built as a run builds it: the recipe validated, the factory of the
    registration called with the section and a placement."""
    import rlcore
    from rlcore.interfaces import Placement

    config = rlcore.build_config({"policy": {"model_name": str(model_dir), "max_total_sequence_length": 192,
                                             "precision": "bfloat16", "generation": {"backend": "sglang", **generation}}},
                                 manager=manager)
    return manager.get("generator", "sglang").build(config, config.generation, Placement(device=device))
