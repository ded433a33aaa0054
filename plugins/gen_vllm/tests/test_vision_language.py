"""Vision-language checkpoints and the vllm generator: vLLM's Qwen-VL models need a working
torchvision (its model code and the model's transformers processor import it). Where torchvision
does not import, the generator's factory refuses such a checkpoint naming the config key and the
hf generator, before vLLM would refuse it with "failed to be inspected"."""

from __future__ import annotations

import pytest

from rlcore.config import ConfigError
from rlcore.interfaces import Placement


def _torchvision_imports() -> bool:
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a CUDA build against a CPU torch
        return False
    return True


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlcore.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", "qwen2_5_vl", num_layers=1, vision_depth=1)


@pytest.mark.skipif(_torchvision_imports(), reason="torchvision imports here: vLLM can load the model")
def test_factory_refuses_a_vision_language_model_without_torchvision(vlm_dir):
    from rlcore.config.schema import PolicyConfig, RunConfig
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import factory

    cfg = VllmConfig()
    run = RunConfig(policy=PolicyConfig(model_name=str(vlm_dir)), sections={"policy.generation": cfg})
    with pytest.raises(ConfigError, match="policy.generation.backend") as info:
        factory(run, cfg, Placement())
    assert "vision-language model (qwen2_5_vl)" in str(info.value) and "torchvision" in str(info.value)
    assert "backend: hf" in str(info.value)


def test_text_only_checkpoints_pass_the_check(tiny_model_dir):
    from rlcore_vllm.generator import check_vision_language

    check_vision_language(str(tiny_model_dir))  # no error: not a vision-language model
