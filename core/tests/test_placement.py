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


# ---- Ray placement groups: checked against the cluster's nodes before any is made ------------

def _ranks(n: int, device: str = "cuda"):
    from rlcore.controller.ray_placement import rank_bundles
    from rlcore.interfaces import Placement

    return rank_bundles(Placement(device=device, trainer_ranks=n, use_ray=True))


GPU_NODES = {"10.0.0.1": {"CPU": 16.0, "GPU": 8.0, "memory": 1e11}, "10.0.0.2": {"CPU": 16.0, "GPU": 8.0}}


def test_one_bundle_per_rank_from_the_placement():
    assert _ranks(3) == [{"CPU": 1.0, "GPU": 1.0}] * 3
    assert _ranks(2, "cpu") == [{"CPU": 1.0}] * 2
    # cluster.gpus_per_node x num_nodes, less the generator's GPUs when not colocated
    placement = plan_placement(_config(gpus_per_node=8, num_nodes=2, gen_gpus=2, ray_address="10.0.0.1:6379"))
    assert placement.trainer_ranks == 14 and placement.generator_gpus == ()


@pytest.mark.parametrize(("ranks", "strategy"), [(16, "PACK"), (16, "SPREAD"), (8, "STRICT_PACK"), (2, "STRICT_SPREAD")])
def test_requests_the_nodes_can_hold(ranks, strategy):
    from rlcore.controller.ray_placement import unsatisfiable

    assert unsatisfiable(_ranks(ranks), GPU_NODES, strategy) is None


def test_requests_the_nodes_cannot_hold_name_what_is_missing():
    from rlcore.controller.ray_placement import unsatisfiable

    assert unsatisfiable(_ranks(20), GPU_NODES, "PACK") == (
        "20 trainer ranks need 20 bundles of {CPU 1, GPU 1} (PACK), but the Ray cluster's 2 alive node(s) "
        "(10.0.0.1: CPU 16, GPU 8; 10.0.0.2: CPU 16, GPU 8) has in all too few: 4 GPU missing")
    assert "all on one node, but no node" in unsatisfiable(_ranks(12), GPU_NODES, "STRICT_PACK")
    assert "the largest lacks 4 GPU" in unsatisfiable(_ranks(12), GPU_NODES, "STRICT_PACK")
    assert "has only 2 node(s) that hold one: 1 node(s) missing" in unsatisfiable(_ranks(3), GPU_NODES, "STRICT_SPREAD")
    # enough GPUs in all, but split so that no node holds a whole bundle's CPU and GPU
    split = {"a": {"CPU": 4.0, "GPU": 0.0}, "b": {"CPU": 0.0, "GPU": 4.0}}
    assert "hold only 0 whole bundles" in unsatisfiable(_ranks(2), split, "SPREAD")
    assert "has in all too few: 2 GPU missing" in unsatisfiable(_ranks(2), {"cpu-only": {"CPU": 64.0}}, "PACK")


def test_placement_strategy_is_a_checked_cluster_key():
    with pytest.raises(ConfigError, match="cluster.placement_strategy"):
        _config(gpus_per_node=2, placement_strategy="SPRAED")


def test_offloading_the_trainer_state_needs_colocated_synchronous_generation():
    def config(colocated: bool, asynchronous: bool):
        return rlcore.build_config({
            "policy": {"model_name": "/nonexistent", "generation": {"backend": "vllm", "colocated": {
                "enabled": colocated, "offload_trainer_state": True}}},
            "algorithm": {"name": "grpo"}, "data": {"name": "arithmetic"}, "env": {"name": "math"},
            "grpo": {"async_grpo": {"enabled": asynchronous}}, "cluster": {"gpus_per_node": 2, "use_ray": True},
        })

    with pytest.raises(ConfigError, match="offload_trainer_state.*colocated.enabled is false"):
        plan_placement(config(colocated=False, asynchronous=False))
    with pytest.raises(ConfigError, match="offload_trainer_state.*async_grpo.enabled is true"):
        plan_placement(config(colocated=True, asynchronous=True))
    assert plan_placement(config(colocated=True, asynchronous=False)).colocated


def test_a_backend_without_offload_names_the_key():
    from rlcore.controller.workers import move_training_state

    class NoOffload:  # a third-party backend written before offload()/onload() joined the protocol
        pass

    with pytest.raises(TypeError, match="offload_trainer_state.*NoOffload has no offload"):
        move_training_state(NoOffload(), 0, 1, True)
