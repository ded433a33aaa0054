"""The tiny CPU recipes of the other post-training families, each run as written (from the
repository root, through ``rlcore run``) for two steps on a random-init tiny Llama. The ``rlcore run``
processes are forked from a server that imported the libraries once (``_preloaded_cli``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _preloaded_cli import PreloadedCli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def run_recipe(tmp_path_factory):
    """``rlcore run RECIPE OVERRIDE...`` from the repository root, in a process of its own; fails unless it exits 0."""
    cli, output = PreloadedCli(), tmp_path_factory.mktemp("cli-output")

    def run(recipe: str, *overrides: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
        result = cli.run_cli(["run", recipe, *overrides], env, output, timeout=240, cwd=ROOT)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result

    yield run
    cli.close()


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_dpo_recipe_raises_held_out_margin(run_recipe, tiny_model_dir, tmp_path, backend):
    """recipes/dpo_tiny_cpu.yaml, two steps: held-out margin 0 (policy = reference) -> positive."""
    switch = (["policy.megatron_cfg.enabled=true", "policy.dtensor_cfg.enabled=false"] if backend == "megatron" else [])
    result = run_recipe("recipes/dpo_tiny_cpu.yaml", f"policy.model_name={tiny_model_dir}",
                         f"logger.log_dir={tmp_path / 'run'}", "train.max_num_steps=2", "train.val_period=2", *switch)
    assert f"training backend: {backend}" in result.stdout
    records = _records(tmp_path / "run")
    assert records[0]["val/reward_margin"] == 0.0 and records[0]["val/accuracy"] == 0.0
    assert records[2]["val/reward_margin"] > 0.05 and records[2]["val/accuracy"] > 0.9, records[2]
    assert records[1]["train/preference_loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy = reference
    assert records[2]["train/preference_loss"] < records[1]["train/preference_loss"]
    assert (tmp_path / "run" / "model" / "config.json").is_file()


@pytest.fixture(scope="module")
def trained_reward_model(tiny_model_dir, tmp_path_factory):
    """recipes/rm_tiny_cpu.yaml run as written (in this process: one device, no process group) for 12 steps."""
    import rlcore

    run_dir = tmp_path_factory.mktemp("rm") / "run"
    config = rlcore.load_config(ROOT / "recipes" / "rm_tiny_cpu.yaml", [
        f"policy.model_name={tiny_model_dir}", f"logger.log_dir={run_dir}", "train.max_num_steps=12", "train.val_period=12",
        f"data.train_files=[{ROOT / 'recipes' / 'data' / 'preference_vowels.jsonl'}]"])
    return rlcore.run(config)


def test_rm_recipe_held_out_pair_accuracy_rises_above_0_8(trained_reward_model):
    summary = trained_reward_model["summary"]
    assert summary["val/accuracy_first"] < 0.7, summary  # a fresh score head ranks pairs about at random
    assert summary["val/accuracy_last"] > 0.8, summary
    records = {r["step"]: r for r in trained_reward_model["records"]}
    assert records[12]["train/bt_loss"] < records[1]["train/bt_loss"]
    assert (Path(trained_reward_model["model_dir"]) / "model.safetensors").is_file()


def test_reward_model_environment_scores_trajectories(trained_reward_model, tiny_tokenizer):
    from rlcore.loading.loader import build_config
    from rlcore.interfaces import Sample
    from rlcore.plugins import get_plugin_manager

    model_dir = trained_reward_model["model_dir"]
    config = build_config({"policy": {"model_name": model_dir}, "env": {"name": "reward_model",
                           "reward_model": {"model": model_dir, "correct_above": 0.0}}})
    env = get_plugin_manager().get("environment", "reward_model").build(config.section("env.reward_model"))
    prompt = [{"role": "user", "content": "word for qzx:"}]  # not in the data file
    sample = Sample(prompt=prompt, prompt_ids=tiny_tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                                                   tokenize=True)["input_ids"])
    steps = env.step([sample] * 4, [["aeiou"], ["uoie"], ["bcdfg"], ["xkq"]])
    rewards = [s.reward for s in steps]
    assert min(rewards[:2]) > max(rewards[2:]), rewards
    assert [s.metrics["correct"] for s in steps] == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(Exception, match="env.reward_model.modle"):
        build_config({"policy": {"model_name": model_dir}, "env": {"name": "reward_model", "reward_model": {"modle": "x"}}})


def test_distill_recipe_lowers_held_out_reverse_kl(run_recipe, tiny_model_dir, tiny_model_factory, tmp_path):
    """recipes/distill_tiny_cpu.yaml, two steps: a random-init student distilled from another
    random-init model; held-out reverse KL to the teacher drops, and the refit probe passes."""
    teacher = tiny_model_factory("llama", seed=1)
    run_recipe("recipes/distill_tiny_cpu.yaml", f"policy.model_name={tiny_model_dir}", f"algorithm.teacher_model={teacher}",
                f"logger.log_dir={tmp_path / 'run'}", "train.max_num_steps=2", "train.val_period=2", "train.max_val_samples=32",
                "train.num_prompts_per_step=8")
    records = _records(tmp_path / "run")
    assert records[0]["val/reverse_kl"] > 0.05, records[0]
    assert records[2]["val/reverse_kl"] < records[0]["val/reverse_kl"], (records[0], records[2])
    assert records[1]["train/reverse_kl"] > 0.05 and "train/teacher_logprobs" not in records[1]
    for step in (1, 2):
        assert records[step]["refit/probe_mean_abs_logprob_diff"] < 1e-4
