"""rlcore-math's component benchmark, as ``rlcore bench component grading`` finds and runs it."""

from __future__ import annotations

import rlcore
from rlcore.plugins import get_plugin_manager
from rlcore.utils import resolve


def test_grading_benchmark_is_registered_and_grades_the_recipes_batches():
    found = get_plugin_manager().benchmarks()
    assert found["grading"] == "rlcore_math.benchmark:grading"
    config = rlcore.build_config({"policy": {"model_name": "unused"}, "env": {"name": "math", "math": {"executor": "inline"}},
                                  "train": {"num_prompts_per_step": 4}, "grpo": {"num_generations_per_prompt": 2}})
    row = resolve(found["grading"])(config, steps=3, warmup=1)
    assert row["responses"] == 2 * 4 * 2  # two timed batches of P x G
    assert 0.2 < row["correct_fraction"] < 0.8  # half of the synthetic responses are right
    assert row["responses_per_s"] > 0 and row["mean_chars"] > 500
