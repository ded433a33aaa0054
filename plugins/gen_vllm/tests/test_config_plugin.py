"""Registration and configuration: no engine, no torch needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlcore.config import ConfigError, structure
from rlcore_vllm.config import VllmConfig


def test_registered_under_the_shared_generation_section():
    from rlcore.plugins import PluginManager

    manager = PluginManager()
    manager.load_entry_points()
    reg = manager.get("generator", "vllm")
    assert reg.section == "policy.generation" and reg.config_cls is VllmConfig
    assert reg.capabilities["engines"] == ("sync", "async")


def test_listing_plugins_imports_neither_torch_nor_vllm():
    code = ("import sys; from rlcore.plugins import PluginManager; m = PluginManager(); m.load_entry_points(); "
            "m.get('generator', 'vllm'); bad = [x for x in ('torch', 'vllm') if x in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_config_from_a_recipe_mapping():
    cfg = structure(VllmConfig, {"backend": "vllm", "async_engine": True, "stop_strings": ["</answer>"],
                                 "colocated": {"enabled": False, "resources": {"gpus_per_node": 1}},
                                 "refit": {"chunk_bytes": 1024, "probe_threshold": 0.1}},
                    "policy.generation")
    assert cfg.async_engine and cfg.stop_strings == ("</answer>",) and not cfg.colocated.enabled
    assert cfg.colocated.resources.gpus_per_node == 1 and cfg.refit.chunk_bytes == 1024


def test_probe_threshold_follows_quantization_unless_set():
    from rlcore_vllm.config import BF16_PROBE_THRESHOLD, FP8_PROBE_THRESHOLD

    assert structure(VllmConfig, {}, "policy.generation").refit.probe_threshold == BF16_PROBE_THRESHOLD
    assert structure(VllmConfig, {"quantization": "fp8"}, "policy.generation").refit.probe_threshold == FP8_PROBE_THRESHOLD
    fixed = structure(VllmConfig, {"quantization": "fp8", "refit": {"probe_threshold": 0.2}}, "policy.generation")
    assert fixed.refit.probe_threshold == 0.2


def test_fp8_on_cpu_fails_before_an_engine_starts():
    from rlcore_vllm.generator import VllmGenerator

    for key, value in (("quantization", "fp8"), ("kv_cache_dtype", "fp8")):
        with pytest.raises(ValueError, match=rf"policy.generation.{key}='fp8' needs a CUDA device"):
            VllmGenerator("/nonexistent-model", structure(VllmConfig, {key: value}, "policy.generation"), device="cpu")
    with pytest.raises(ValueError, match=r"policy.generation.return_routed_experts needs a CUDA device"):
        VllmGenerator("/nonexistent-model", structure(VllmConfig, {"return_routed_experts": True}, "policy.generation"), device="cpu")


def test_engine_process_choice():
    """None (auto): on CUDA, in this process only for colocated sync runs; on CPU, vLLM's own setting."""
    from rlcore_vllm.generator import engine_in_own_process as own

    assert own(None, device="cuda", colocated=True, async_grpo=False) is False
    assert own(None, device="cuda", colocated=True, async_grpo=True) is True  # rollout thread off this interpreter
    assert own(None, device="cuda", colocated=False, async_grpo=False) is True
    assert own(None, device="cpu", colocated=True, async_grpo=True) is None
    assert own(True, device="cuda", colocated=True, async_grpo=False) is True
    assert own(False, device="cpu", colocated=True, async_grpo=True) is False
    with pytest.raises(ConfigError, match=r"policy\.generation\.experimental\.engine_process.*GPUs of its own"):
        own(False, device="cuda", colocated=False, async_grpo=False)


def test_experimental_switches_live_in_their_own_section():
    """The measured-alternative switches are under ``experimental``; at the top level they are unknown keys."""
    cfg = structure(VllmConfig, {"experimental": {"executor": "uni", "engine_process": False}}, "policy.generation")
    assert cfg.experimental.executor == "uni" and cfg.experimental.engine_process is False
    assert VllmConfig().experimental.request_seeds is True and VllmConfig().experimental.engine_detokenize is False
    for key in ("executor", "engine_process", "request_seeds", "engine_detokenize", "rollout_stream_priority"):
        with pytest.raises(ConfigError) as err:
            structure(VllmConfig, {key: True}, "policy.generation")
        assert err.value.key == f"policy.generation.{key}"


@pytest.mark.parametrize("colocated, device, sleeps", [
    ({}, "cuda", True), ({"sleep_level": 2}, "cuda", True), ({"sleep_level": 0}, "cuda", False),
    ({"enabled": False}, "cuda", False), ({}, "cpu", False),
])
def test_sleep_level_0_keeps_a_colocated_engine_resident(colocated, device, sleeps):
    """Level 0 starts the engine without vLLM's sleep mode and never sleeps it; the generator still
    refuses to generate between sleep() and wake_up() (checked on the real engine in test_sync_engine)."""
    from rlcore_vllm.generator import VllmGenerator

    generator = VllmGenerator.__new__(VllmGenerator)  # engine kwargs only: no engine is started
    generator.config = structure(VllmConfig, {"colocated": colocated}, "policy.generation")
    generator.device, generator.model_path, generator.max_model_len = device, "/model", 64
    generator.memory_fraction = generator.config.engine_memory_fraction(None)
    assert generator._sleeps is sleeps
    assert generator._engine_kwargs("bfloat16", 0, None).get("enable_sleep_mode", False) is sleeps


@pytest.mark.parametrize("data, key", [
    ({"colocated": {"sleep_level": 3}}, "policy.generation.colocated.sleep_level"),
    ({"quantization": "int4"}, "policy.generation.quantization"),
    ({"temprature": 0.5}, "policy.generation.temprature"),
    ({"refit": {"chunk_byte": 1}}, "policy.generation.refit.chunk_byte"),
    ({"prompt_overflow": "wrap"}, "policy.generation.prompt_overflow"),
    ({"experimental": {"engine_process": "sometimes"}}, "policy.generation.experimental.engine_process"),
    ({"experimental": {"executor": "ray"}}, "policy.generation.experimental.executor"),
    ({"top_p": 1.5}, "policy.generation.top_p"),
])
def test_bad_keys_and_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        structure(VllmConfig, data, "policy.generation")
    assert err.value.key == key
    assert key.rsplit(".", 1)[-1] in str(err.value)


def test_codecs_round_trip_direct_and_shared_memory():
    import torch

    from rlcore_vllm.codecs import decode, encode

    chunk = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.arange(7, dtype=torch.bfloat16)),
             ("c", torch.randn(2, 2, dtype=torch.float64).t())]
    for mode in ("direct", "shm"):
        encoded = encode(chunk, mode)
        out = decode(encoded.payload)
        assert [n for n, _ in out] == [n for n, _ in chunk]
        for (_, want), (_, got) in zip(chunk, out):
            assert got.dtype == want.dtype and torch.equal(got, want)
        encoded.release()
    with pytest.raises(ValueError, match="unknown weight encoding"):
        encode(chunk, "pigeon")


def test_request_seeds_false_sends_requests_without_their_own_seed():
    from types import SimpleNamespace

    from rlcore.interfaces import SamplingParams
    from rlcore_vllm.generator import VllmGenerator

    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7, n=4)
    for request_seeds, expected in ((True, 7), (False, None)):
        owner = SimpleNamespace(config=structure(VllmConfig, {"experimental": {"request_seeds": request_seeds}},
                                                  "policy.generation"), max_model_len=64)
        assert VllmGenerator._vllm_params(owner, params, prompt_len=10, n=4).seed == expected
