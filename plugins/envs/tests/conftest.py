"""A two-step GRPO run on CPU (tiny Llama, fsdp2 backend, hf generator) through one of this plugin's environments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def grpo_recipe(model_dir: Path, run_dir: Path, data: dict, env: dict, **grpo) -> dict:
    return {
        "policy": {
            "model_name": str(model_dir), "precision": "float32", "max_total_sequence_length": 160,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True},
            "generation": {"backend": "hf", "max_new_tokens": 8, "temperature": 1.0},
        },
        "algorithm": {"name": "grpo"},
        "data": data,
        "env": env,
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": 2, "val_period": 2,
                 "max_val_samples": 4, "seed": 3, **grpo},
        "logger": {"log_dir": str(run_dir), "print_table": False, "plot": False},
        "checkpointing": {"enabled": False},
    }


@pytest.fixture
def run_grpo(tiny_model_dir, tmp_path):
    """``run_grpo(data, env) -> (summary, records)`` of a two-step run in this process."""

    def run(data: dict, env: dict, **grpo):
        import rlcore

        result = rlcore.run(rlcore.build_config(grpo_recipe(tiny_model_dir, tmp_path / "run", data, env, **grpo)))
        records = [json.loads(line) for line in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        return result["summary"], records

    return run
