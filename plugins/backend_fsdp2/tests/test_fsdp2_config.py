"""policy.dtensor_cfg schema, plugin registration, mesh validation and the LR schedule (no
processes, no model weights)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlcore.config.structure import ConfigError, structure
from rlcore_fsdp2.config import SECTION, DTensorConfig
from rlcore_fsdp2.parallel_dims import ParallelDims
from rlcore.training.schedule import lr_factor


def test_defaults_are_nemo_rl_keys():
    cfg = DTensorConfig()
    assert cfg.enabled is True and cfg.cpu_offload is False and cfg.sequence_parallel is False
    assert cfg.activation_checkpointing is False and cfg.custom_parallel_plan is None
    assert (cfg.tensor_parallel_size, cfg.context_parallel_size) == (1, 1)


def test_unknown_key_names_the_closest():
    with pytest.raises(ConfigError) as err:
        structure(DTensorConfig, {"tensor_paralel_size": 2}, SECTION)
    assert err.value.key == "policy.dtensor_cfg.tensor_paralel_size"
    assert "tensor_parallel_size" in str(err.value)


@pytest.mark.parametrize("data, key, words", [
    ({"context_parallel_size": 2}, "context_parallel_size", "supports only 1"),
    ({"sequence_parallel": True}, "sequence_parallel", "tensor_parallel_size > 1"),
    ({"custom_parallel_plan": "no_colon"}, "custom_parallel_plan", "module:attr"),
    ({"tensor_parallel_size": 0}, "", "tensor_parallel_size"),
])
def test_bad_values_name_the_key(data, key, words):
    with pytest.raises(ConfigError) as err:
        structure(DTensorConfig, data, SECTION)
    assert key in err.value.key or key in str(err.value)
    assert words in str(err.value)


def test_registered_without_importing_torch():
    code = (
        "import sys; from rlcore.plugins import get_plugin_manager\n"
        "reg = get_plugin_manager().get('training_backend', 'fsdp2')\n"
        "assert reg.section == 'policy.dtensor_cfg' and reg.config_cls.__name__ == 'DTensorConfig'\n"
        "caps = reg.capabilities\n"
        "assert caps['devices'] == ('cpu', 'cuda') and caps['packing'] is True and caps['precedence'] == 0\n"
        "assert set(caps['parallelism']) == {'dp', 'tp', 'sp'}\n"
        "assert 'torch' not in sys.modules, 'listing plugins imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_mesh_must_cover_the_world():
    assert ParallelDims.from_config(tp=2, cp=1, world_size=8).dp_shard == 4
    with pytest.raises(ConfigError, match=r"does not divide the world size 6"):
        ParallelDims.from_config(tp=4, cp=1, world_size=6)
    with pytest.raises(ConfigError, match=r"= 4, but the world has 8 ranks"):
        ParallelDims(dp_shard=2, cp=1, tp=2, world_size=8)


def test_model_checks():
    from transformers import GPT2Config

    from rlcore.testing.tiny import tiny_config

    with pytest.raises(ValueError, match=r"unsupported architecture: model_type 'gpt2'.*llama, qwen2, qwen3, qwen3_moe"):
        ParallelDims(1, 1, 1, 1).check_model(GPT2Config())
    with pytest.raises(ConfigError, match=r"does not divide the model's num_key_value_heads \(1\)"):
        ParallelDims(1, 1, 2, 2).check_model(tiny_config("llama", num_heads=2, num_kv_heads=1))
    ParallelDims(1, 1, 2, 2).check_model(tiny_config("qwen3", num_heads=4, num_kv_heads=2))


def test_lr_schedule():
    kw = dict(warmup_steps=2, decay_steps=6, lr=1.0, min_lr=0.1)
    assert [lr_factor(s, decay_style="constant", **kw) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    linear = [lr_factor(s, decay_style="linear", **kw) for s in range(8)]
    assert linear[:3] == [0.5, 1.0, 1.0] and linear[4] == pytest.approx(0.55) and linear[6:] == [pytest.approx(0.1)] * 2
    cosine = [lr_factor(s, decay_style="cosine", **kw) for s in range(8)]
    assert cosine[4] == pytest.approx(0.55) and cosine[3] > linear[3] and cosine[7] == pytest.approx(0.1)


def test_empty_cache_after_train_follows_colocation_unless_set():
    from rlcore.interfaces import Placement, WorldInfo
    from rlcore_fsdp2.backend import _empty_cache_after_train
    from rlcore_fsdp2.config import DTensorExperimentalConfig

    def world(colocated):
        return WorldInfo(device="cuda", placement=Placement(device="cuda", colocated=colocated))

    assert _empty_cache_after_train(WorldInfo(), DTensorConfig())  # default placement: colocated
    assert _empty_cache_after_train(world(True), DTensorConfig())
    assert not _empty_cache_after_train(world(False), DTensorConfig())
    assert not _empty_cache_after_train(world(True), DTensorConfig(experimental=DTensorExperimentalConfig(empty_cache_after_train=False)))
    assert _empty_cache_after_train(world(False), DTensorConfig(experimental=DTensorExperimentalConfig(empty_cache_after_train=True)))
