"""One ``max_new_tokens`` default for every generator, and ``rlcore config --defaults``."""

from __future__ import annotations

import json

from rlcore.cli import main
from rlcore.config.generation import DEFAULT_MAX_NEW_TOKENS
from rlcore.interfaces import SamplingParams
from rlcore.plugins import get_plugin_manager


def test_every_generator_schema_keeps_the_one_max_new_tokens_default():
    generators = get_plugin_manager().registry["generator"].values()
    assert generators
    for reg in generators:
        assert reg.config_cls().max_new_tokens == DEFAULT_MAX_NEW_TOKENS, reg.name
    assert SamplingParams().max_new_tokens == DEFAULT_MAX_NEW_TOKENS


def test_config_defaults_prints_core_keys_and_each_plugin_section(capsys):
    assert main(["config", "--defaults", "--json"]) == 0
    defaults = json.loads(capsys.readouterr().out)
    core = defaults["core"]
    assert core["policy"]["model_name"] == "<required>" and core["policy"]["precision"] == "bfloat16"
    assert core["grpo"]["num_generations_per_prompt"] == 8 and core["env"]["name"] == "math"
    by_name = {(s["path"], s["name"]): s["defaults"] for s in defaults["sections"]}
    assert by_name[("policy.generation", "hf")]["max_new_tokens"] == DEFAULT_MAX_NEW_TOKENS
    assert by_name[("algorithm", "grpo")]["use_old_logprobs"] == "auto"
    assert main(["config", "--defaults"]) == 0
    text = capsys.readouterr().out
    assert "# policy.generation: generator 'hf' (rlcore)" in text and "model_name: <required>" in text
