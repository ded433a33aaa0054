"""Where trainer and generator go on GPUs when they do not share them (checked before any GPU use)."""

from __future__ import annotations

import pytest

import rlcore
from rlcore.config import ConfigError
from rlcore.controller.run import build_trainer, driver_gpu_ids
from rlcore.plugins import get_plugin_manager


def _config(**cluster):
    return rlcore.build_config({
        "policy": {"model_name": "/nonexistent", "generation": {"backend": "vllm", "colocated": {
            "enabled": False, "resources": {"gpus_per_node": cluster.pop("gen_gpus", 1)}}}},
        "algorithm": {"name": "grpo"}, "data": {"name": "arithmetic"}, "env": {"name": "math"},
        "cluster": cluster,
    })


def test_driver_keeps_the_gpus_the_trainer_actors_do_not_hold():
    assert driver_gpu_ids(None, 2, 1) == ["1"]
    assert driver_gpu_ids(None, 8, 6) == ["6", "7"]
    assert driver_gpu_ids("4,5,6,7", 4, 2) == ["6", "7"]  # physical ids from the visible list


def test_no_gpu_left_for_generation_names_the_key():
    with pytest.raises(ConfigError, match="colocated.resources.gpus_per_node"):
        driver_gpu_ids(None, 2, 2)
    with pytest.raises(ConfigError, match="colocated.resources.gpus_per_node.*leaving none for the trainer"):
        build_trainer(_config(gpus_per_node=2, gen_gpus=2), get_plugin_manager())


def test_non_colocated_gpus_refuse_a_trainer_in_the_driver_process():
    with pytest.raises(ConfigError, match="cluster.use_ray.*own process"):
        build_trainer(_config(gpus_per_node=2, gen_gpus=1, use_ray=False), get_plugin_manager())
