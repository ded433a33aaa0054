"""The megatron backend trains text-only models: a vision-language checkpoint is a config error
naming the key and the backend that trains it."""

from __future__ import annotations

import pytest

from rlcore.config import ConfigError


def test_vision_language_model_is_a_clear_config_error(tmp_path):
    from rlcore.config.schema import PolicyConfig, RunConfig
    from rlcore.interfaces import WorldInfo
    from rlcore.testing.tiny_vlm import build_vlm_tokenizer, tiny_vlm_config
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.config import SECTION, MegatronConfig

    tiny_vlm_config(build_vlm_tokenizer()).save_pretrained(tmp_path)
    cfg = MegatronConfig()
    config = RunConfig(policy=PolicyConfig(model_name=str(tmp_path)), sections={SECTION: cfg})
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.enabled.*vision-language model.*fsdp2 backend"):
        MegatronBackend(config, cfg, WorldInfo())
