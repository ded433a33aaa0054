"""One ``max_new_tokens`` default for every generator, and ``rlcore config --defaults``."""

from __future__ import annotations

import json

from rlcore.cli.commands import main
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


def test_an_engines_memory_share_is_the_recipes_else_the_plans_else_the_unplanned_default():
    from rlcore.config.generation import UNPLANNED_ENGINE_FRACTION, GenerationConfig

    assert GenerationConfig(gpu_memory_utilization=0.6).engine_memory_fraction(0.2) == 0.6
    assert GenerationConfig().engine_memory_fraction(0.2) == 0.2
    assert GenerationConfig().engine_memory_fraction(None) == UNPLANNED_ENGINE_FRACTION


def test_a_prompt_fits_the_engines_context_by_the_overflow_policy():
    from rlcore.interfaces import GenerationResult
    from rlcore.data.prompts import fit_to_context

    assert fit_to_context([1, 2, 3], 4, "drop") == ([1, 2, 3], None)
    assert fit_to_context([1, 2, 3, 4], 4, "truncate") == ([2, 3, 4], "truncated")
    assert fit_to_context([1, 2, 3, 4], 4, "drop") == (None, "dropped")
    dropped = GenerationResult.dropped([1, 2, 3, 4], 7)
    assert (dropped.response_ids, dropped.finish_reason, dropped.policy_version) == ([], "truncated_prompt", 7)
