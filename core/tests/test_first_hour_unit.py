"""The first hour of a new user, the parts that need no training run: recipes' log dirs and the
demo's previous run, labels, plain reward functions, early checks, the CLI's output when piped
or narrow, described defaults, verbosity. (The runs themselves: tests/test_first_hour.py.)"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlcore.config import ConfigError
from rlcore.loading.loader import build_config

REPO = Path(__file__).resolve().parents[2]


def base_recipe(model_dir: Path, run_dir: Path, **extra) -> dict:
    recipe = {"policy": {"model_name": str(model_dir), "dtensor_cfg": {"enabled": True}, "generation": {"backend": "hf"}},
              "algorithm": {"name": "grpo"}, "data": {"name": "arithmetic", "digits": 1, "num_validation": 8, "num_train": 32},
              "logger": {"log_dir": str(run_dir)}}
    recipe.update(extra)
    return recipe


# ---- 1. recipes and the demo -------------------------------------------------------------------
def test_no_recipe_logs_into_the_demos_directory():
    """`make demo` writes runs/demo/{base,sft,grpo}; a recipe run right after it must not find its
    log_dir taken by the demo's run."""
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        log_dir = (yaml.safe_load(path.read_text()).get("logger") or {}).get("log_dir", "runs/latest")
        assert not Path(log_dir).is_relative_to("runs/demo"), f"{path.name}: logger.log_dir {log_dir} is the demo's"


def test_the_demo_moves_the_previous_run_aside(tmp_path):
    from rlcore.cli.demo import move_aside

    run = tmp_path / "grpo"
    assert move_aside(run) is None
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "20261204-101010-abcdef"}))
    (run / "metrics.jsonl").write_text("{}\n")
    kept = move_aside(run)
    assert kept == tmp_path / "grpo-20261204-101010-abcdef" and (kept / "metrics.jsonl").read_text() == "{}\n"
    assert not run.exists()
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "20261204-101010-abcdef"}))
    assert move_aside(run) == tmp_path / "grpo-20261204-101010-abcdef-2"  # never over an earlier one


def test_a_shipped_recipe_is_found_by_name(tmp_path, monkeypatch):
    from rlcore.loading.loader import load_config
    from rlcore.loading.shipped import shipped_recipe, shipped_recipes

    assert set(shipped_recipes()) == {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    monkeypatch.chdir(tmp_path)  # no recipes/ here: a wheel's user
    for name in ("grpo_arith_tiny_cpu", "grpo_arith_tiny_cpu.yaml", "recipes/grpo_arith_tiny_cpu.yaml"):
        assert shipped_recipe(name).read_text() == (REPO / "recipes" / "grpo_arith_tiny_cpu.yaml").read_text()
        assert load_config(name, ["train.max_num_steps=3"]).train.max_num_steps == 3
    for name in ("mine/grpo_arith_tiny_cpu.yaml", "./x/recipes/grpo_arith_tiny_cpu", "grpo_arith_tiny_cpu.yml", "nothere"):
        assert shipped_recipe(name) is None, name  # a path of the user's is never swapped for a shipped recipe
    with pytest.raises(ConfigError, match="recipe not found: nothere .*rlcore recipes"):
        load_config("nothere")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "grpo_arith_tiny_cpu.yaml").write_text("policy: {model_name: mine}\n")
    assert load_config("recipes/grpo_arith_tiny_cpu.yaml").policy.model_name == "mine"  # a local file wins


def test_rlcore_recipes_lists_prints_and_copies_out(run_cli, tmp_path):
    listed = run_cli("recipes")
    assert listed.returncode == 0 and "grpo_arith_tiny_cpu" in listed.stdout, listed.stderr
    shown = run_cli("recipes", "sft_arith_tiny_cpu")
    assert shown.stdout == (REPO / "recipes" / "sft_arith_tiny_cpu.yaml").read_text()
    out = tmp_path / "mine.yaml"
    assert run_cli("recipes", "sft_arith_tiny_cpu", "--out", str(out)).returncode == 0
    assert out.read_text() == shown.stdout
    again = run_cli("recipes", "sft_arith_tiny_cpu", "--out", str(out))
    assert again.returncode == 2 and "--force" in again.stderr  # never overwrites an edited copy unasked
    unknown = run_cli("recipes", "grpo_nothere")
    assert unknown.returncode == 2 and "rlcore recipes" in unknown.stderr


# ---- 2. export/eval errors say how to get a checkpoint; a run directory's final model exports --
def test_export_of_a_directory_without_checkpoints_says_how_to_get_one(tmp_path):
    from rlcore.errors import CheckpointError
    from rlcore.cli.export import find_checkpoint

    with pytest.raises(CheckpointError, match=r"<logger.log_dir>/model.*checkpointing.enabled=true"):
        find_checkpoint(tmp_path)


def test_export_of_a_run_without_checkpoints_copies_its_final_model(tiny_model_dir, tmp_path):
    from rlcore.cli.export import export_checkpoint

    shutil.copytree(tiny_model_dir, tmp_path / "run" / "model")
    done = export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert done["checkpoint"] == str(tmp_path / "run" / "model")
    assert (tmp_path / "out" / "config.json").read_text() == (tiny_model_dir / "config.json").read_text()


# ---- 3. verbosity --------------------------------------------------------------------------------
def test_quiet_turns_the_libraries_down_and_verbose_leaves_them(run_python):
    code = """
        import logging, os
        from rlcore.controller.verbosity import apply_verbosity
        apply_verbosity("quiet")
        print(os.environ["VLLM_LOGGING_LEVEL"], os.environ["HF_HUB_DISABLE_PROGRESS_BARS"], logging.getLogger("vllm").level)
    """
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS")}
    assert run_python(code, env=env).stdout.split() == ["ERROR", "1", "40"]
    verbose = run_python(code.replace('"quiet"', '"verbose"').replace('os.environ["VLLM_LOGGING_LEVEL"]', 'os.environ.get("VLLM_LOGGING_LEVEL")')
                         .replace('os.environ["HF_HUB_DISABLE_PROGRESS_BARS"]', 'os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")'), env=env)
    assert verbose.stdout.split() == ["None", "None", "0"]


def test_run_verbose_flag_sets_logger_verbosity():
    from rlcore.cli.commands import build_parser, run_overrides

    args = build_parser().parse_args(["run", "r.yaml", "a.b=1", "--verbose"])
    assert run_overrides(args) == ["a.b=1", "logger.verbosity=verbose"]
    with pytest.raises(ConfigError, match="logger.verbosity"):
        build_config({"policy": {"model_name": "m"}, "logger": {"verbosity": "loud"}})


# ---- 6. labels -------------------------------------------------------------------------------------
def test_summary_is_titled_by_algorithm_and_names_its_columns():
    from rich.console import Console

    from rlcore.controller.report import Reporter
    from rlcore.controller.run_end import summary_table

    console = Console(file=io.StringIO(), width=80)
    console.print(summary_table({"window_first": 2, "window_last": 5, "timing/reward": 0.15,
                                 "val/accuracy_first": 0.3828125, "val/accuracy_last": 0.7578125,
                                 "val/reverse_kl_first": 1.5, "val/reverse_kl_last": 0.25}, "distillation"))
    text = console.file.getvalue()
    assert "distillation summary" in text and "GRPO" not in text
    assert "Scoring" in text and "Reward" not in text  # the environment's seconds, not a reward
    assert "accuracy 0.383 -> 0.758 (+0.375)" in text and "reverse_kl 1.500 -> 0.250 (-1.250)" in text
    reporter = Reporter(3, console=Console(file=io.StringIO(), width=300))
    reporter.step({"step": 1, "timing/logprobs": 0.1}, 1)
    shown = reporter.console.file.getvalue()
    assert "logprobs" in shown and "probe mean/max:" in shown and "scoring:" in shown


def test_the_step_table_starts_with_the_held_out_accuracy_before_training():
    from rich.console import Console

    from rlcore.controller.report import Reporter

    reporter = Reporter(3, console=Console(file=io.StringIO(), width=300))
    reporter.start({"step": 0, "val/accuracy": 0.421875})
    reporter.step({"step": 1, "train/reward_mean": 0.5, "timing/total": 1.0}, 1)
    rows = reporter.console.file.getvalue().splitlines()[2:]  # under the header and the legend
    assert rows[0].split()[:3] == ["0", "-", "0.422"] and rows[1].split()[:3] == ["1", "0.500", "-"], rows


def test_a_silent_run_prints_what_it_is_doing_every_few_seconds():
    import threading

    from rlcore.controller.heartbeat import doing, heartbeat, said

    lines, written = [], threading.Event()

    def write(line):
        lines.append(line)
        written.set()

    doing("outside any block")  # a no-op
    with heartbeat(every_s=0.2, write=write):
        doing("starting the generator")
        said()
        assert written.wait(60), "no line while the block was silent"
    count = len(lines)
    assert lines[0].startswith("... starting the generator: ") and lines[0].endswith("s")
    doing("after the block")
    threading.Event().wait(0.5)
    assert len(lines) == count  # the thread ended with its block


def test_the_demo_ends_with_the_commands_to_type_next_and_their_environment(tmp_path):
    """``make demo`` runs .venv's python without activating .venv: the commands it suggests need it."""
    script = Path(sys.executable).parent / "rlcore"
    code = ("from pathlib import Path; from rlcore.cli.demo import next_commands, RECIPE; "
            "print(next_commands(Path('runs/demo/grpo'), Path('runs/demo/sft'), str(RECIPE)))")
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert bare.returncode == 0, bare.stderr
    lines = bare.stdout.strip().splitlines()
    assert lines[0] == "next:" and f"source {os.path.relpath(script.parent, REPO) if script.is_relative_to(REPO) else script.parent}/activate" in lines[1]
    assert any(line.split()[:2] == ["rlcore", "eval"] and "runs/demo/grpo recipes/grpo_arith_tiny_cpu.yaml" in line for line in lines)
    active = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PATH": f"{script.parent}{os.pathsep}/usr/bin:/bin"})
    assert "activate" not in active.stdout and "rlcore plugins" in active.stdout  # rlcore on PATH: nothing to add


# ---- 7. a plain reward function ---------------------------------------------------------------------
def exact_sum(prompts, completions, **kwargs):
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, kwargs["answer"])]


def test_a_trl_style_reward_function_is_an_environment():
    from rlcore.interfaces import Sample
    from rlcore.data.reward_fn import FunctionEnvironment, as_environment

    samples = [Sample(prompt="1+1=", answer=2, metadata={"level": 1}), Sample(prompt="2+2=", answer=4, metadata={"level": 2})]
    seen = {}

    def fn(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return exact_sum(prompts, completions, **kwargs)

    steps = FunctionEnvironment(fn).step(samples, [["2"], ["5"]])
    assert [s.reward for s in steps] == [1.0, 0.0] and all(s.done for s in steps)
    assert seen == {"prompts": ["1+1=", "2+2="], "completions": ["2", "5"], "answer": [2, 4], "level": [1, 2]}
    env = as_environment({"reward_fn": exact_sum})["environment"]
    assert isinstance(env, FunctionEnvironment) and env.fn is exact_sum
    assert isinstance(as_environment({"environment": exact_sum})["environment"], FunctionEnvironment)
    with pytest.raises(TypeError, match="both"):
        as_environment({"reward_fn": exact_sum, "environment": env})


def test_a_reward_function_never_stops_the_run_on_model_output(capsys):
    from rlcore.interfaces import Sample
    from rlcore.data.reward_fn import FunctionEnvironment

    def parses(prompts, completions, **kwargs):
        return [float(int(c)) for c in completions]  # raises on text that is not a number

    env = FunctionEnvironment(parses)
    samples = [Sample(prompt="p", answer=1)] * 2
    steps = env.step(samples, [["3"], ["three"]])
    assert [s.reward for s in steps] == [0.0, 0.0] and [s.metrics["reward_fn_errors"] for s in steps] == [1.0, 1.0]
    env.step(samples, [["x"], ["y"]])
    assert capsys.readouterr().out.count("raised ValueError") == 1  # said once
    # None ("does not apply") scores 0; NaN stays NaN, which the loop scores 0 and counts in env/errors
    none, nan = FunctionEnvironment(lambda prompts, completions, **kw: [None, float("nan")]).step(samples, [["a"], ["b"]])
    assert none.reward == 0.0 and math.isnan(nan.reward)
    with pytest.raises(ValueError, match="returned 1 rewards for 2 completions"):
        FunctionEnvironment(lambda prompts, completions, **kw: [1.0]).step(samples, [["a"], ["b"]])


def test_env_reward_fn_names_a_function(tmp_path, monkeypatch):
    from rlcore.controller.environment import build_environment
    from rlcore.plugins import get_plugin_manager
    from rlcore.data.reward_fn import load_reward_fn

    (tmp_path / "my_rewards_i62.py").write_text("def fn(prompts, completions, **kw):\n    return [0.5] * len(completions)\nx = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = build_config({"policy": {"model_name": "m"}, "env": {"reward_fn": "my_rewards_i62:fn"}})
    env, multi_turn = build_environment(config, get_plugin_manager(), {})
    assert env.name == "my_rewards_i62:fn" and not multi_turn
    from rlcore.interfaces import Sample

    assert [s.reward for s in env.step([Sample(prompt="p")], [["c"]])] == [0.5]
    for spec, why in (("my_rewards_i62", "module:function"), ("my_rewards_i62:nope", "cannot be imported"),
                      ("no_such_module_i62:fn", "cannot be imported"), ("my_rewards_i62:x", "not a function")):
        with pytest.raises(ConfigError, match=why) as info:
            load_reward_fn(spec)
        assert info.value.key == "env.reward_fn"


def test_rlcore_run_takes_a_reward_function(tiny_model_dir, tmp_path):
    """``rlcore.run(config, reward_fn=fn)``: one step of the real loop scored by a plain function."""
    import rlcore

    calls = []

    def counting(prompts, completions, **kwargs):
        calls.append(len(completions))
        return exact_sum(prompts, completions, **kwargs)

    config = build_config(base_recipe(tiny_model_dir, tmp_path / "run", train={"num_prompts_per_step": 2, "max_num_steps": 1},
        grpo={"num_generations_per_prompt": 2},
        logger={"log_dir": str(tmp_path / "run"), "print_table": False, "plot": False},
        policy={"model_name": str(tiny_model_dir), "precision": "float32", "max_total_sequence_length": 32,
                "dtensor_cfg": {"enabled": True}, "generation": {"backend": "hf", "max_new_tokens": 2}}))
    result = rlcore.run(config, reward_fn=counting)
    assert calls and calls[0] == 4 and result["summary"]["steps"] == 1
    assert (tmp_path / "run" / "model" / "config.json").is_file()  # GRPO keeps its final model


def test_rows_with_a_prompt_column_are_a_dataset_as_in_trl(tiny_model_dir):
    """Text prompts are used as they are (TRL's standard format); chat messages go through the chat
    template with its generation prompt (conversational); a DatasetDict's test split is held out."""
    datasets = pytest.importorskip("datasets")
    from transformers import AutoTokenizer

    from rlcore.data.rows import rows_dataset

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = rows_dataset(datasets.Dataset.from_dict({"prompt": ["1+2=", "3+4="], "answer": [3, 7], "level": [1, 2]}), tokenizer)
    assert text.validation is None and [s.answer for s in text.train] == [3, 7]
    assert text.train[0].prompt_ids == tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    assert text.train[1].metadata == {"level": 2} and text.train[1].index == 1
    chat = [{"role": "user", "content": "1+2="}]
    split = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": chat, "answer": 3}]),
                                  "test": datasets.Dataset.from_list([{"prompt": chat, "answer": 3}] * 2)})
    conversational = rows_dataset(split, tokenizer)
    assert conversational.train[0].prompt_ids == tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                                               tokenize=True, return_dict=False)
    assert len(conversational.validation) == 2
    assert rows_dataset([{"prompt": "1+2=", "answer": 3}], tokenizer).train[0].prompt_ids == text.train[0].prompt_ids


def test_rows_without_a_prompt_are_refused_before_the_run_starts(tmp_path):
    datasets = pytest.importorskip("datasets")
    import rlcore

    config = build_config({"policy": {"model_name": str(tmp_path / "never-loaded")}, "logger": {"log_dir": str(tmp_path / "run")}})
    with pytest.raises(TypeError, match=r"no 'prompt' column \(they have \['question', 'answer'\]\)"):
        rlcore.run(config, dataset=datasets.Dataset.from_dict({"question": ["1+2="], "answer": [3]}), reward_fn=exact_sum)
    assert not (tmp_path / "run").exists()


def test_trls_quickstart_task_in_a_few_lines(tiny_model_dir, tmp_path):
    """TRL's quickstart (a hub dataset with a prompt column, a reward function, a model name) as
    rlcore.run: no recipe, no dataset class; one real step."""
    datasets = pytest.importorskip("datasets")
    import rlcore

    seen = []

    def unique_chars(completions, **kwargs):  # TRL's quickstart reward
        seen.append(sorted(kwargs))
        return [float(len(set(c))) for c in completions]

    dataset = datasets.Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(8)], "source": ["x"] * 8})
    config = rlcore.build_config({"policy": {"model_name": str(tiny_model_dir), "dtensor_cfg": {"enabled": True},
                                             "generation": {"backend": "hf", "max_new_tokens": 3}},
                                  "algorithm": {"name": "grpo"}, "logger": {"log_dir": str(tmp_path / "run"), "plot": False}},
                                 ["train.max_num_steps=1", "train.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2"])
    result = rlcore.run(config, dataset=dataset, reward_fn=unique_chars)
    assert result["summary"]["steps"] == 1 and seen and "source" in seen[0]  # the other columns reach the function


# ---- 8. checks before anything heavy starts ---------------------------------------------------------
def test_a_logger_whose_package_is_missing_fails_before_the_run_starts(tiny_model_dir, tmp_path, fake_site, monkeypatch):
    """A logger registered with ``requires`` a package that is not installed: refused, naming the key,
    before the run directory is claimed (so before any model loads)."""
    import rlcore

    fake_site.add_plugin("rlcore-nolog", "nolog", """
        import attrs
        import rlcore

        @attrs.frozen
        class Cfg:
            enabled: bool = attrs.field(default=False, metadata={"doc": "on"})

        @rlcore.hookimpl
        def rlcore_loggers(register):
            register("nolog", "rlcore.loggers.jsonl:JsonlLogger", Cfg, requires=("no_such_client_i62",))
    """)
    monkeypatch.setattr("rlcore.plugins._MANAGER", None)  # loaded afresh with the fake distribution; restored after
    if True:
        config = build_config(base_recipe(tiny_model_dir, tmp_path / "run", logger={
            "log_dir": str(tmp_path / "run"), "nolog": {"enabled": True}}))
        with pytest.raises(ConfigError, match="no_such_client_i62 is not installed: pip install no_such_client_i62") as info:
            rlcore.run(config)
        assert info.value.key == "logger.nolog.enabled"
        assert not (tmp_path / "run").exists()


def test_a_model_directory_without_a_tokenizer_names_the_key(tiny_model_dir, tmp_path):
    from rlcore.controller.model_files import check_model_name

    (tmp_path / "m").mkdir()
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "m" / "config.json")
    config = build_config({"policy": {"model_name": str(tmp_path / "m")}})
    with pytest.raises(ConfigError, match="holds no tokenizer") as info:
        check_model_name(config)
    assert info.value.key == "policy.model_name"
    check_model_name(build_config({"policy": {"model_name": str(tmp_path / "m"), "tokenizer_name": str(tiny_model_dir)}}))


def test_config_refuses_what_run_refuses(run_cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"policy": {"model_name": "m"}, "env": {"name": "maht"}}))
    done = run_cli("config", str(recipe))
    assert done.returncode == 2 and "env.name" in done.stderr and "did you mean 'math'" in done.stderr, done.stderr
    wandb = run_cli("config", str(recipe), "env.name=math", "logger.wandb.enabled=true")
    if shutil.which("true") and not _installed("wandb"):
        assert wandb.returncode == 2 and "logger.wandb.enabled" in wandb.stderr and "pip install wandb" in wandb.stderr


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---- 9. output when narrow or piped; defaults with descriptions ---------------------------------------
def test_plugins_fits_80_columns(run_cli):
    done = run_cli("plugins")  # run_cli sets COLUMNS=250; the table must not need it
    narrow = subprocess.run([sys.executable, "-m", "rlcore.cli", "plugins"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "80"})
    assert narrow.returncode == 0 and done.returncode == 0
    lines = narrow.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "…" not in narrow.stdout and "..." not in narrow.stdout
    for word in ("rlcore-megatron", "rlcore-math", "training backend", "grpo", "jsonl", "policy.megatron_cfg"):
        assert word in narrow.stdout, word


def test_plugins_json_into_a_closed_pipe_is_quiet():
    done = subprocess.run(f"{sys.executable} -m rlcore.cli plugins --json | head -c 10", shell=True, capture_output=True,
                          text=True)
    assert done.stdout.startswith("[") and done.stderr == "", done.stderr


def test_config_defaults_describe_each_key(run_cli):
    done = run_cli("config", "--defaults")
    assert done.returncode == 0, done.stderr
    assert "verbosity: quiet  # quiet: the libraries underneath" in done.stdout
    assert "max_num_steps: 100  # " in done.stdout and "reward_fn: null  # 'module:function'" in done.stdout
    yaml.safe_load(done.stdout)  # still YAML: the descriptions are comments
    plain = run_cli("config", "--defaults", "--no-descriptions")
    assert "  # " not in plain.stdout


def test_a_shipped_recipes_data_file_is_found_outside_a_checkout(tmp_path, monkeypatch):
    from rlcore.data.preference.config import PreferenceDataConfig
    from rlcore.data.preference.data import _read_rows
    from rlcore.loading.shipped import shipped_data_file

    monkeypatch.chdir(tmp_path)  # no recipes/ here: the DPO and RM recipes' recipes/data/... is the shipped file
    config = PreferenceDataConfig(train_files=("recipes/data/preference_vowels.jsonl",))
    assert _read_rows("recipes/data/preference_vowels.jsonl", config) == _read_rows(
        str(REPO / "recipes" / "data" / "preference_vowels.jsonl"), config)
    for name in ("data/preference_vowels.jsonl", "mine/data/preference_vowels.jsonl", "recipes/data/nothere.jsonl"):
        assert shipped_data_file(name) is None, name  # only recipes/data/NAME of a shipped file
    (tmp_path / "recipes" / "data").mkdir(parents=True)
    (tmp_path / "recipes" / "data" / "preference_vowels.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    assert shipped_data_file("recipes/data/preference_vowels.jsonl") is None  # a local file wins
    assert len(_read_rows("recipes/data/preference_vowels.jsonl", config)) == 1
