"""Where trainer and generator go on GPUs when they do not share them (checked before any GPU use)."""

from __future__ import annotations

import pytest

import rlcore
from rlcore.config import ConfigError
from rlcore.controller.placement import driver_gpu_ids, plan_placement


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
        plan_placement(_config(gpus_per_node=2, gen_gpus=2))


def test_non_colocated_gpus_refuse_a_trainer_in_the_driver_process():
    with pytest.raises(ConfigError, match="cluster.use_ray.*own process"):
        plan_placement(_config(gpus_per_node=2, gen_gpus=1, use_ray=False))


def test_one_placement_names_both_sides(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    placement = plan_placement(_config(gpus_per_node=4, gen_gpus=1))
    assert (placement.device, placement.trainer_ranks, placement.use_ray, placement.colocated) == ("cuda", 3, True, False)
    assert placement.generator_gpus == ("3",)
    colocated = plan_placement(rlcore.build_config({"policy": {"model_name": "/x", "generation": {"backend": "hf"}},
                                                    "cluster": {"cpu_workers": 2}}))
    assert (colocated.device, colocated.trainer_ranks, colocated.use_ray, colocated.colocated) == ("cpu", 2, True, True)
    assert colocated.generator_gpus == ()
