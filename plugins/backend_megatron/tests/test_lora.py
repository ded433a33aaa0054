"""policy.lora on the megatron backend: which layers the Hugging Face target names adapt, and the
configurations it refuses, naming the key. (Training, export and resume: test_distributed.py.)"""

from __future__ import annotations

import importlib.util

import pytest

# Found, not imported, at collection: importing megatron.core takes seconds, paid by the tests that run here.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_hugging_face_names_map_onto_the_fused_layers():
    from rlcore_megatron.lora import targets

    assert targets(ALL) == {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
                            "self_attention.linear_proj": ("o_proj",), "mlp.linear_fc1": ("gate_proj", "up_proj"),
                            "mlp.linear_fc2": ("down_proj",)}
    # a subset of a fused layer's projections adapts those alone, in the layer's row order
    assert targets(("v_proj", "q_proj")) == {"self_attention.linear_qkv": ("q_proj", "v_proj")}
    # a Megatron name means every projection of its layer
    assert targets(("linear_fc1", "o_proj")) == {"mlp.linear_fc1": ("gate_proj", "up_proj"),
                                                 "self_attention.linear_proj": ("o_proj",)}


@pytest.mark.parametrize("names, message", [(("qkv",), "'qkv' is not a layer"), ((), "is empty")])
def test_bad_target_names_name_the_key(names, message):
    from rlcore.config import ConfigError
    from rlcore_megatron.lora import targets

    with pytest.raises(ConfigError, match=rf"policy\.lora\.target_modules.*{message}"):
        targets(names)


def test_refused_configurations_name_the_key():
    from types import SimpleNamespace

    from rlcore.config import ConfigError
    from rlcore import build_config
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.lora import apply

    config = build_config({"policy": {"model_name": "x", "lora": {"enabled": True},
                                      "megatron_cfg": {"enabled": True, "cuda_graph": "micro_batch"}}})
    with pytest.raises(ConfigError, match=r"policy\.lora\.enabled.*experts"):
        apply(None, config.policy.lora, SimpleNamespace(num_experts=4), seed=0)
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.cuda_graph"):
        MegatronBackend._apply_lora(None, None, config.section("policy.megatron_cfg"), config, 0)


def test_te_op_fuser_is_turned_off_for_lora_and_refused_when_asked_for():
    import attrs

    from rlcore.config import ConfigError
    from rlcore_megatron.config import MegatronConfig
    from rlcore_megatron.kernels import resolve
    from rlcore_megatron.lora import kernels_for_lora

    # its fused MLP would run linear_fc1/linear_fc2 past their adapters' hooks
    fused = attrs.evolve(resolve(MegatronConfig(enabled=True), on_cuda=False), te_op_fuser=True)  # as resolved with TE
    assert kernels_for_lora(fused, MegatronConfig(enabled=True)).te_op_fuser is False
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.use_te_op_fuser"):
        kernels_for_lora(fused, MegatronConfig(enabled=True, use_te_op_fuser=True))
