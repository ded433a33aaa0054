"""Values that used to fail at step 1 (or silently meant something else) are refused when the
config is loaded or the run's parts are built, naming the key."""

from __future__ import annotations

import pytest

from rlcore.config import ConfigError
from rlcore.loading.loader import build_config
from rlcore.config.schema import PolicyConfig, RunConfig
from rlcore.controller.model_files import check_model_name


def _recipe(**policy) -> dict:
    return {"policy": {"model_name": "m", "generation": {"backend": "hf"}, **policy}}


@pytest.mark.parametrize("key, value", [
    ("policy.generation.max_new_tokens", 0),
    ("policy.generation.max_new_tokens", -4),
    ("policy.generation.temperature", -1.0),
    ("policy.generation.top_k", 0),
    ("policy.train_global_batch_size", 0),
    ("policy.train_global_batch_size", -8),
])
def test_out_of_range_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError) as failure:
        build_config(_recipe(), [f"{key}={value}"])
    assert failure.value.key == key, failure.value


def test_greedy_and_all_rollouts_are_still_spelled_explicitly():
    config = build_config(_recipe(), ["policy.generation.temperature=0", "policy.train_global_batch_size=null"])
    assert config.section("policy.generation").temperature == 0.0 and config.policy.train_global_batch_size is None


@pytest.mark.parametrize("make, says", [
    (lambda tmp: tmp / "missing", "no such directory"),
    (lambda tmp: tmp, "no config.json"),
    (lambda tmp: (tmp / "weights.bin").write_bytes(b"x") and tmp / "weights.bin", "is a file"),
])
def test_a_model_name_that_is_not_a_model_is_refused_naming_the_key(tmp_path, make, says):
    name = make(tmp_path)
    with pytest.raises(ConfigError) as failure:
        check_model_name(RunConfig(policy=PolicyConfig(model_name=str(name))))
    assert failure.value.key == "policy.model_name" and says in str(failure.value)


def test_a_critic_model_that_is_not_a_model_is_refused_naming_its_key(tmp_path, tiny_model_dir):
    recipe = {"policy": {"model_name": str(tiny_model_dir), "generation": {"backend": "hf"}},
              "algorithm": {"name": "ppo", "critic": {"model_name": str(tmp_path / "missing")}}}
    with pytest.raises(ConfigError) as failure:
        check_model_name(build_config(recipe))
    assert failure.value.key == "algorithm.critic.model_name" and "no such directory" in str(failure.value)
    recipe["algorithm"]["critic"]["model_name"] = str(tiny_model_dir)
    check_model_name(build_config(recipe))


def test_a_model_directory_passes(tiny_model_dir):
    check_model_name(RunConfig(policy=PolicyConfig(model_name=str(tiny_model_dir))))


def test_the_backend_chosen_is_said_at_start_with_the_others_enabled(capsys):
    from rlcore.controller.engines import select_backend
    from rlcore.plugins import get_plugin_manager

    manager = get_plugin_manager()
    if not {"megatron", "fsdp2"} <= set(manager.registry["training_backend"]):
        pytest.skip("needs rlcore-megatron and rlcore-fsdp2 installed")
    config = build_config(_recipe(dtensor_cfg={"enabled": True}, megatron_cfg={"enabled": True}), manager=manager)
    assert select_backend(config, manager).name == "megatron"
    out = capsys.readouterr().out
    assert "training backend: megatron (policy.megatron_cfg)" in out and "fsdp2 (policy.dtensor_cfg)" in out
