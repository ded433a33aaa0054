"""Every recipe in ``recipes/`` resolves (``rlcore config``) and runs two steps on CPU.

The dry run keeps a recipe's algorithm, backend, generator kind, environment, async mode and
checkpointing, and swaps in what a CPU can run: a tiny random model of the same architecture, a
tiny arithmetic dataset, one process (parallel sizes 1), the built-in ``hf`` generator for vLLM,
fp32, a few short sequences. A recipe can steer its dry run from its header comment:

    # dry-run-arch: qwen2                  (the tiny architecture, when policy.model_name does not say)
    # dry-run-keep: data                   (sections left as the recipe has them, e.g. a DPO pair dataset)
    # dry-run: data.num_validation=8       (dotted overrides applied last)
    # dry-run-logs: env/vf/reward/exact    (metrics the two steps must log, e.g. an adapter's own)

All dry runs share one process (``_recipe_dry_runs.py``): imports dominate on two cores.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import yaml

from rlcore.config import ConfigError
from rlcore.loading.loader import load_config

RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))
# Vision-language recipes need a tiny VLM and their image dataset, not the text swaps below: the fsdp2
# plugin's vision tests run them (plugins/backend_fsdp2/tests/test_fsdp2_vision.py).
VISION_ARCHS = ("qwen2_5_vl", "qwen3_vl")
RUNNER = Path(__file__).with_name("_recipe_dry_runs.py")
TINY = dict(hidden_size=256, num_heads=4, num_kv_heads=2)  # the shapes the Megatron and export tests build too
PARALLEL_SIZES = {
    "dtensor_cfg": {"tensor_parallel_size": 1, "sequence_parallel": False, "cpu_offload": False, "compile": False},
    "megatron_cfg": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                     "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None, "sequence_parallel": False,
                     "num_layers_in_first_pipeline_stage": None, "num_layers_in_last_pipeline_stage": None},
}


def header(path: Path) -> dict[str, list[str]]:
    """The recipe's leading comment lines, and its ``# dry-run...:`` directives by name."""
    lines, directives = [], {"dry-run": [], "dry-run-arch": [], "dry-run-keep": [], "dry-run-logs": []}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
        key, sep, value = line.lstrip("# ").partition(":")
        if sep and key in directives:
            directives[key] += value.split()
    return {"lines": lines, **directives}


def tiny_arch(model_name: str, directives: dict) -> str:
    if directives["dry-run-arch"]:
        return directives["dry-run-arch"][0]
    name = model_name.lower()
    if "qwen3" in name:
        return "qwen3_moe" if ("a3b" in name or "moe" in name) else "qwen3"
    if "qwen" in name:  # Qwen2, Qwen2.5 and the R1 distills of them
        return "qwen2"
    if "llama" in name:
        return "llama"
    raise ValueError(f"cannot tell the architecture of {model_name!r}: add '# dry-run-arch: <llama|qwen2|qwen3|qwen3_moe>'")


def dry_run_config(path: Path, model_dir: Path, log_dir: Path) -> dict:
    """The recipe (as a dict) with the CPU swaps of the module docstring."""
    from rlcore.config.hf_generation import HFGenerationConfig

    recipe = yaml.safe_load(path.read_text())
    keep = set(header(path)["dry-run-keep"])
    out = copy.deepcopy(recipe)
    policy = out["policy"]
    policy.update(model_name=str(model_dir), tokenizer_name=None, max_total_sequence_length=64, precision="float32",
                  train_global_batch_size=None)
    policy["sequence_packing"] = {**policy.get("sequence_packing", {}), "train_mb_tokens": 512, "logprob_mb_tokens": 512}
    for section, sizes in PARALLEL_SIZES.items():
        if isinstance(policy.get(section), dict) and policy[section].get("enabled"):
            policy[section].update({k: v for k, v in sizes.items() if k in policy[section] or v is not None})
    if "policy.generation" not in keep and "generation" in policy:
        allowed = {f.name for f in attrs.fields(HFGenerationConfig)} - {"colocated", "refit", "dtype"}
        generation = {k: v for k, v in policy["generation"].items() if k in allowed}
        policy["generation"] = {**generation, "backend": "hf", "max_new_tokens": 4}
    if (out.get("algorithm") or {}).get("teacher_model"):  # distillation: the tiny model teaches itself
        out["algorithm"]["teacher_model"] = str(model_dir)
    if "data" not in keep:
        out["data"] = {"name": "arithmetic", "digits": 1, "num_train": 64, "num_validation": 4}
    for name, section in (out.get("env") or {}).items():
        if isinstance(section, dict) and "executor" in section:
            section.update(executor="inline", num_workers=1)
    out["train"] = {**out.get("train", {}), "num_prompts_per_step": 2, "max_num_steps": 2, "val_period": 2, "max_val_samples": 4,
                    "val_at_start": False}
    out["grpo"] = {**out.get("grpo", {}), "num_generations_per_prompt": 2}
    out["cluster"] = {"gpus_per_node": 0, "num_nodes": 1, "cpu_workers": 1}
    loggers = {k: ({**v, "enabled": False} if k != "jsonl" else v) for k, v in (out.get("logger") or {}).items() if isinstance(v, dict)}
    out["logger"] = {**loggers, "log_dir": str(log_dir), "print_table": False, "plot": False}
    if out.get("checkpointing", {}).get("enabled"):
        out["checkpointing"] = {**out["checkpointing"], "checkpoint_dir": None, "save_period": 2, "keep_last_k": 1}
    return out


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_resolves_and_has_a_header(path):
    config = load_config(path)  # what `rlcore config recipes/X.yaml` prints
    assert config.policy.model_name
    assert header(path)["lines"], f"{path.name} has no header comment saying which model, hardware and task it is for"


@pytest.mark.parametrize("name", ["sft_arith_tiny_cpu", "dpo_tiny_cpu", "rm_tiny_cpu"])
def test_the_offline_trainers_recipes_count_their_steps_under_train(name):
    path = Path(__file__).parents[1] / "recipes" / f"{name}.yaml"
    recipe = yaml.safe_load(path.read_text())
    assert "grpo" not in recipe, f"{path.name}: nothing of an SFT, DPO or reward-model run is GRPO's"
    assert load_config(path).train.max_num_steps == recipe["train"]["max_num_steps"]
    config = load_config(path, ["train.max_num_steps=3", "train.num_prompts_per_step=5", "train.val_period=0"])
    assert (config.train.max_num_steps, config.train.num_prompts_per_step, config.train.val_period) == (3, 5, 0)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["grpo.max_num_steps=3"])
    assert info.value.key == "grpo.max_num_steps" and "write 'train.max_num_steps' instead" in str(info.value)


@pytest.fixture(scope="module")
def dry_runs(tiny_model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipes")
    plan = {}
    for path in RECIPES:
        directives = header(path)
        arch = tiny_arch(yaml.safe_load(path.read_text())["policy"]["model_name"], directives)
        if arch in VISION_ARCHS or needs_missing_sandbox(path):
            continue
        model = tiny_model_factory(arch, **TINY)
        plan[path.stem] = {"config": dry_run_config(path, model, out / path.stem), "overrides": directives["dry-run"]}
    (out / "plan.json").write_text(json.dumps(plan))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, str(RUNNER), str(out / "plan.json"), str(out / "results.json")], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode or not (out / "results.json").is_file():
        pytest.fail("dry runs failed:\n" + proc.stdout[-3000:] + proc.stderr[-3000:])
    return json.loads((out / "results.json").read_text())


def needs_missing_sandbox(path: Path) -> bool:
    """The code environment runs each solution under bubblewrap (rlcore_envs.sandbox), which a machine may lack (.ci/run
    installs it); its own tests skip there too."""
    return (yaml.safe_load(path.read_text()).get("env") or {}).get("name") == "code" and shutil.which("bwrap") is None


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_dry_run_two_steps_on_cpu(dry_runs, path):
    if needs_missing_sandbox(path):
        pytest.skip(f"{path.name}: its code environment's sandbox needs bwrap (apt-get install bubblewrap)")
    if path.stem not in dry_runs:
        pytest.skip(f"{path.name} is a vision-language recipe, run by the fsdp2 plugin's vision tests")
    result = dry_runs[path.stem]
    if isinstance(result, str):
        pytest.fail(f"{path.name}: {result}")
    assert result["steps"] == 2
    assert result["val_last"] is not None  # the held-out split was validated at step 2
    missing = set(header(path)["dry-run-logs"]) - set(result["logged"])
    assert not missing, f"{path.name}: the dry run logged none of {sorted(missing)}"


def test_a_hub_model_that_cannot_be_had_fails_before_any_worker(tmp_path):
    recipe = Path(__file__).parents[1] / "recipes" / "grpo_math_1B.yaml"
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="250")  # this machine cannot reach the hub either: offline fails fast
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "run", str(recipe), f"logger.log_dir={tmp_path / 'run'}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("config key 'policy.model_name': 'Qwen/Qwen2.5-1.5B-Instruct' is not a local directory and not in the "
            "Hugging Face cache, and HF_HUB_OFFLINE is set") in proc.stderr
    assert "training backend:" not in proc.stdout  # no backend, generator or Ray was started
