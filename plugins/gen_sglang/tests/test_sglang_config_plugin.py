"""Registration, configuration and the engine's arguments: no engine, no SGLang needed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.config import ConfigError, structure
from rlcore_sglang.config import SglangConfig

from _sglang_helpers import build_generator

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
SRC = Path(__file__).resolve().parents[1] / "src"


def test_registered_under_the_shared_generation_section(sglang_plugin_manager):
    reg = sglang_plugin_manager.get("generator", "sglang")
    assert reg.section == "policy.generation" and reg.config_cls is SglangConfig
    assert reg.capabilities["devices"] == ("cuda",) and reg.capabilities["requires"] == ("sglang",)


def test_listing_plugins_imports_neither_torch_nor_sglang():
    code = ("import sys, rlcore_sglang.plugin; from rlcore.plugins import PluginManager; m = PluginManager(); "
            "m.load_entry_points(); m.register_module(rlcore_sglang.plugin); m.get('generator', 'sglang'); "
            "bad = [x for x in ('torch', 'sglang') if x in sys.modules]; assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


def test_a_recipe_selects_the_schema_and_keeps_the_vllm_key_names(sglang_plugin_manager):
    import rlcore

    config = rlcore.build_config({"policy": {"model_name": "/model", "generation": {
        "backend": "sglang", "enforce_eager": True, "stop_strings": ["</answer>"], "gpu_memory_utilization": 0.4,
        "colocated": {"sleep_level": 2}, "refit": {"chunk_bytes": 1024}}}}, manager=sglang_plugin_manager)
    gen = config.generation
    assert isinstance(gen, SglangConfig) and gen.enforce_eager and gen.stop_strings == ("</answer>",)
    assert gen.colocated.sleep_level == 2 and gen.refit.chunk_bytes == 1024 and gen.gpu_memory_utilization == 0.4
    assert gen.engine_in_own_process(async_grpo=False)  # its scheduler's process: the memory plan counts its context
    with pytest.raises(ConfigError) as err:  # a vLLM-only key: the message names it and where it is
        rlcore.build_config({"policy": {"model_name": "/model", "generation": {"backend": "sglang", "async_engine": True}}},
                            manager=sglang_plugin_manager)
    assert err.value.key == "policy.generation.async_engine"


@pytest.mark.parametrize("data, key", [
    ({"tp_size": 0}, "policy.generation.tp_size"),
    ({"colocated": {"sleep_level": 3}}, "policy.generation.colocated.sleep_level"),
    ({"colocated": {"sleep_levl": 1}}, "policy.generation.colocated.sleep_levl"),
    ({"dtype": "float8"}, "policy.generation.dtype"),
    ({"max_model_len": 1}, "policy.generation.max_model_len"),
    ({"max_running_requests": 0}, "policy.generation.max_running_requests"),
    ({"prompt_overflow": "wrap"}, "policy.generation.prompt_overflow"),
    ({"log_level": "loud"}, "policy.generation.log_level"),
    ({"enforce_eagr": True}, "policy.generation.enforce_eagr"),
    ({"refit": {"chunk_byte": 1}}, "policy.generation.refit.chunk_byte"),
    ({"return_routed_experts": True}, "policy.generation.return_routed_experts"),
    ({"top_p": 1.5}, "policy.generation.top_p"),
])
def test_bad_keys_and_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        structure(SglangConfig, data, "policy.generation")
    assert err.value.key == key
    assert key.rsplit(".", 1)[-1] in str(err.value)


@pytest.mark.parametrize("colocated, saver, backup", [
    ({}, True, True), ({"sleep_level": 2}, True, False), ({"sleep_level": 0}, False, False),
    ({"enabled": False}, False, False),
])
def test_server_args_follow_the_section(colocated, saver, backup):
    from rlcore_sglang.generator import server_args

    cfg = structure(SglangConfig, {"colocated": colocated, "enforce_eager": True, "tp_size": 2, "enable_prefix_caching": False},
                    "policy.generation")
    args = server_args(cfg, "/model", tokenizer_path=None, max_model_len=512, dtype="bfloat16", seed=7,
                       memory_fraction=cfg.engine_memory_fraction(0.35))
    assert args["enable_memory_saver"] is saver and args["enable_weights_cpu_backup"] is backup
    assert args["disable_cuda_graph"] is True and args["disable_radix_cache"] is True and args["tp_size"] == 2
    assert args["context_length"] == 512 and args["random_seed"] == 7 and args["tokenizer_path"] == "/model"
    assert args["mem_fraction_static"] == 0.35 and "max_running_requests" not in args


def test_memory_share_is_the_recipes_else_the_plan_else_half():
    from rlcore.config.generation import UNPLANNED_ENGINE_FRACTION

    assert SglangConfig(gpu_memory_utilization=0.6).engine_memory_fraction(0.2) == 0.6
    assert SglangConfig().engine_memory_fraction(0.2) == 0.2
    assert SglangConfig().engine_memory_fraction(None) == UNPLANNED_ENGINE_FRACTION == 0.5


def test_on_cpu_the_factory_fails_naming_the_fix(sglang_plugin_manager):
    with pytest.raises(ConfigError, match=r"runs on CUDA GPUs only.*cluster.gpus_per_node") as err:
        build_generator(sglang_plugin_manager, "/nonexistent-model", device="cpu")
    assert err.value.key == "policy.generation.backend"


@pytest.mark.skipif(HAS_SGLANG, reason="sglang is installed here")
def test_without_sglang_the_factory_fails_naming_the_package_and_version(sglang_plugin_manager):
    needs = r"needs the sglang package.*pip install 'rlcore-sglang\[cuda\]' \(sglang==0\.5\.17"
    with pytest.raises(ConfigError, match=needs) as err:
        build_generator(sglang_plugin_manager, "/nonexistent-model", device="cuda")
    assert err.value.key == "policy.generation.backend"


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang is not installed (no CPU build on the package index; the GPU check "
                    "installs sglang 0.5.17: benchmarks/gpu/README.md)")
def test_server_args_are_fields_of_sglangs_server_args():
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    from rlcore_sglang.generator import server_args

    args = server_args(SglangConfig(max_running_requests=8), "/model", tokenizer_path=None, max_model_len=512,
                       dtype="bfloat16", seed=0, memory_fraction=0.3)
    assert set(args) <= {f.name for f in dataclasses.fields(ServerArgs)}
