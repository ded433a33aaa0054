"""What the config, the data or a plugin already says is wrong is an error before the first step,
naming the key, file, row or plugin: not a run that trains nothing and exits 0, nor a traceback
from deep inside numpy, torch or a tokenizer later."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlcore.config import ConfigError
from rlcore.loading.loader import build_config, load_config
from rlcore.generation.batching import EnvironmentContractError, Trajectory, apply_env_steps, score
from rlcore.controller.checkpoint import CheckpointManager, CheckpointWriteError
from rlcore.deadlines import EnvironmentExit, TimedEnvironment
from rlcore.controller.model_files import check_model_name
from rlcore.controller.preflight import check_pairs, check_run_sizes
from rlcore.interfaces import EnvStep, GenerationResult, PreferencePair, Sample

BASE = {"policy": {"model_name": "m", "generation": {"backend": "hf"}}}


# ---- config values that mean nothing ----------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ("policy.optimizer.lr=inf", "policy.optimizer.lr"),
    ("policy.optimizer.lr=nan", "policy.optimizer.lr"),
    ("policy.optimizer.betas=[nan,2]", "policy.optimizer.betas[0]"),
    ("policy.optimizer.betas=[0.9,2]", "policy.optimizer.betas"),
    ("policy.max_grad_norm=-1", "policy.max_grad_norm"),
    ("policy.max_grad_norm=nan", "policy.max_grad_norm"),
    ("train.seed=-1", "train.seed"),
    ("grpo.summary_window=[5,2]", "grpo.summary_window"),
    ("algorithm.std_floor=inf", "algorithm.std_floor"),
    ("env.math.correct_reward=nan", "env.math.correct_reward"),
])
def test_a_value_that_means_nothing_is_refused_naming_the_key(override, key):
    data = {**BASE, "algorithm": {"name": "grpo"}}
    with pytest.raises(ConfigError) as failure:
        build_config(data, [override])
    assert failure.value.key == key, failure.value


@pytest.mark.parametrize("text, says", [
    ("train:\n  seed: 1\n  seed: 2\n", "given twice in one mapping (lines 2 and 3)"),
    ("base: &b {seed: 1}\ntrain: *b\n", "alias *b is not allowed"),
    ("policy: {model_name: m}\n\x00\x01\x02", "NUL bytes"),
    ("policy:\n  ? [a, b]\n  : 1\n", "line 2: a key that is a YAML sequence"),
    ("train:\n  ? {seed: 1}\n  : 2\n", "line 2: a key that is a YAML mapping"),
])
def test_a_recipe_file_that_hides_a_mistake_is_refused_naming_it(tmp_path, text, says):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="recipe.yaml") as failure:
        load_config(path)
    assert says in str(failure.value)


def test_a_recipe_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"policy:\n  model_name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"not a UTF-8 text file \(byte 0xe9 on line 2\)"):
        load_config(path)


# ---- sizes the data and the algorithm must allow ------------------------------------------------
def _sized(*overrides: str):
    config = build_config({**BASE, "algorithm": {"name": "grpo"}}, list(overrides))
    from rlcore.plugins import get_plugin_manager

    algorithm = get_plugin_manager().get("algorithm", "grpo").build(config.section("algorithm"))
    dataset = SimpleNamespace(train=[Sample(prompt=str(i)) for i in range(16)], validation=None)
    return config, dataset, algorithm


@pytest.mark.parametrize("overrides, key", [
    (["train.num_prompts_per_step=1e8"], "train.num_prompts_per_step"),
    (["grpo.num_generations_per_prompt=1"], "grpo.num_generations_per_prompt"),
    (["grpo.num_generations_per_prompt=100000000"], "grpo.num_generations_per_prompt"),  # memory, before any is used
    (["policy.sequence_packing.train_mb_tokens=1"], "policy.sequence_packing.train_mb_tokens"),
])
def test_sizes_the_run_cannot_have_are_refused_before_the_first_step(overrides, key):
    with pytest.raises(ConfigError) as failure:
        check_run_sizes(*_sized("train.num_prompts_per_step=4", *overrides))
    assert failure.value.key == key, failure.value
    check_run_sizes(*_sized("train.num_prompts_per_step=4"))  # the same run without it passes
    check_run_sizes(*_sized("train.num_prompts_per_step=4", "grpo.num_generations_per_prompt=1",
                            "algorithm.normalize_std=false"))  # one sample per prompt without std normalization


# ---- preference pairs ---------------------------------------------------------------------------
def _pairs(*pairs: PreferencePair) -> SimpleNamespace:
    return SimpleNamespace(train=list(pairs), validation=None)


def test_an_identical_pair_is_refused_naming_its_row():
    config = build_config(BASE, ["policy.max_total_sequence_length=16"])
    ok = PreferencePair([1, 2], [3, 4], [5], source="p.jsonl: row 0")
    with pytest.raises(ConfigError, match="p.jsonl: row 1: chosen and rejected are the same"):
        check_pairs(_pairs(ok, PreferencePair([1, 2], [3, 4], [3, 4], source="p.jsonl: row 1")), config)


@pytest.mark.parametrize("policy_choice", ["drop", "error"])
def test_an_overlong_pair_is_found_before_training(policy_choice, capsys):
    config = build_config(BASE, ["policy.max_total_sequence_length=8", f"policy.overlong_prompts={policy_choice}"])
    data = _pairs(PreferencePair([1, 2], [3], [4], source="p.jsonl: row 0"),
                  PreferencePair([1] * 6, [3, 3], [4, 4, 4], source="p.jsonl: row 1"))
    if policy_choice == "error":
        with pytest.raises(ConfigError, match="p.jsonl: row 1") as failure:
            check_pairs(data, config)
        assert failure.value.key == "policy.max_total_sequence_length"
        return
    assert check_pairs(data, config) == {"train": 1}
    assert [p.source for p in data.train] == ["p.jsonl: row 0"]
    assert "1 of 2 preference pairs" in capsys.readouterr().out


# ---- what an environment returns ---------------------------------------------------------------
def _trajs(n: int) -> list[Trajectory]:
    return [Trajectory(Sample(prompt="p"), 0, GenerationResult(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0],
                                                                  finish_reason="stop"))
            for _ in range(n)]


@pytest.mark.parametrize("step, says", [
    (EnvStep(reward=None), "reward for trajectory 0 is NoneType"),
    (EnvStep(reward="1"), "reward for trajectory 0 is str"),
    (EnvStep(reward=1.0, metrics={"acc": "high"}), "metric 'acc' of trajectory 0 is str"),
])
def test_a_reward_or_metric_that_is_no_number_names_it(step, says):
    with pytest.raises(EnvironmentContractError, match=says):
        apply_env_steps(_trajs(1), [step])


class Returns:
    def __init__(self, result):
        self.result = result

    def step(self, samples, responses):
        return self.result


@pytest.mark.parametrize("result, says", [
    (None, "returned NoneType None from step() for 4 trajectories"),
    ([EnvStep(reward=1.0)], "returned 1 results from step() for 4 trajectories"),
    (["1.0", "0.0", "1.0", "0.0"], "result for trajectory 0 is str '1.0'; it must be an EnvStep"),
])
def test_an_environment_returning_no_envstep_per_trajectory_stops_the_run_naming_it(result, says):
    """Scored 0 as "errors" instead, such a run would exit 0 having learned nothing."""
    env = TimedEnvironment(Returns(result), "broken_env", timeout_s=30, on_timeout="stop")
    with pytest.raises(EnvironmentContractError, match=says.replace("(", r"\(").replace(")", r"\)")) as failure:
        score(env, _trajs(4))
    assert "broken_env" in str(failure.value) or "trajectory 0" in str(failure.value)


@pytest.mark.parametrize("rewards", [["yes", "no"], [float("nan"), 1.0], ["1.0", 1.0]], ids=["words", "nan", "numeric-text"])
def test_a_reward_function_returning_no_number_warns_and_counts_env_errors(rewards, capsys):
    from rlcore.data.reward_fn import FunctionEnvironment

    env = TimedEnvironment(FunctionEnvironment(lambda prompts, completions, **kw: rewards, "my_rewards:fn"),
                           "my_rewards:fn", timeout_s=30, on_timeout="stop")
    trajs = _trajs(2)
    metrics = score(env, trajs)
    bad = sum(1 for r in rewards if isinstance(r, str) or r != r)
    assert metrics["env/errors"] == bad and [t.reward for t in trajs] == [0.0 if isinstance(r, str) or r != r else r
                                                                          for r in rewards]
    assert "reward function my_rewards:fn returned" in capsys.readouterr().out


def test_rewards_beyond_float32_count_as_errors_and_nan_metrics_leave_the_mean():
    trajs = _trajs(3)
    metrics = apply_env_steps(trajs, [EnvStep(reward=1e300, metrics={"m": float("nan")}),
                                      EnvStep(reward=-1e300, metrics={"m": 1.0}), EnvStep(reward=0.5, metrics={"m": 3.0})])
    assert [t.reward for t in trajs] == [0.0, 0.0, 0.5]
    assert metrics["env/errors"] == 2.0 and metrics["env/m"] == 2.0


def test_an_environment_calling_sys_exit_stops_the_run_saying_so():
    class Exits:
        def step(self, samples, responses):
            raise SystemExit(3)

    env = TimedEnvironment(Exits(), "exits", timeout_s=30, on_timeout="stop")
    env.current_step = 4
    with pytest.raises(EnvironmentExit, match=r"environment 'exits' called sys.exit\(3\) at step 4"):
        score(env, _trajs(2))
    box: dict = {}
    worker = threading.Thread(target=_score_in, args=(env, box))
    worker.start()
    worker.join(30)
    assert isinstance(box.get("error"), EnvironmentExit)  # off the main thread (async scoring) too


def _score_in(env, box):
    try:
        score(env, _trajs(1))
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        box["error"] = exc


# ---- plugins whose factories return the wrong thing --------------------------------------------
@pytest.mark.parametrize("kind, returned, shown", [
    ("environment", "a string", "str 'a string'"),
    ("environment", None, "NoneType None"),
    ("generator", {"generate": 1}, "dict {'generate': 1}"),
    ("algorithm", None, "NoneType None"),
    ("algorithm", "grpo", "str 'grpo'"),
    ("algorithm", {"advantages": None}, "dict {'advantages': None}"),
    ("dataset", None, "NoneType None"),
    ("dataset", {"train": []}, "dict {'train': []}"),
    ("training_backend", "fsdp2", "str 'fsdp2'"),
])
def test_a_factory_returning_the_wrong_object_is_refused_at_build_naming_the_plugin(kind, returned, shown):
    from rlcore.plugins import PluginError, Registration, Source

    reg = Registration(kind=kind, name="broken", factory=lambda *a: returned, config_cls=None, section=None,
                       capabilities={}, source=Source("acme-rl", "1.2", "broken = acme.plugin"))
    with pytest.raises(PluginError) as failure:
        reg.build(None)
    message = str(failure.value)
    assert f"{kind} 'broken' from acme-rl 1.2" in message and f"returned {shown}" in message
    assert "rlcore.interfaces." in message


def test_every_plugin_kind_checks_its_factorys_product_and_the_built_in_algorithms_pass():
    from rlcore.interfaces.members import BUILT_CHECKS
    from rlcore.plugins import KINDS, get_plugin_manager

    assert set(BUILT_CHECKS) == set(KINDS)
    manager = get_plugin_manager()
    for reg in manager.registry["algorithm"].values():  # checked at build: each built-in follows the protocol
        if reg.source.distribution == "rlcore":
            assert reg.build(reg.config_cls()) is not None, reg.name


# ---- files and targets --------------------------------------------------------------------------
def test_a_pickled_pytorch_model_bin_is_refused_naming_the_key(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(ConfigError, match="pickled pytorch_model.bin") as failure:
        from rlcore.config.schema import PolicyConfig, RunConfig

        check_model_name(RunConfig(policy=PolicyConfig(model_name=str(tmp_path))))
    assert failure.value.key == "policy.model_name"


def test_a_full_disk_torch_reports_as_unexpected_pos_is_the_checkpoint_write_error(tmp_path, monkeypatch):
    import shutil

    def torch_writer_on_a_full_disk(path: str) -> None:  # injected fault: DCP's writer hits a full disk
        Path(path).mkdir()
        monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=1 << 30, used=1 << 30, free=4096))
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    with pytest.raises(CheckpointWriteError, match="no space left on device"):
        CheckpointManager(tmp_path, 2).save(1, torch_writer_on_a_full_disk, {"step": 1, "run": {"run_id": "r"}})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_export_to_a_directory_that_cannot_be_written_is_refused_first(tmp_path):  # pragma: no cover - root in CI
    from rlcore.cli.export import check_writable_target

    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="cannot be written"):
        check_writable_target(locked / "model")


def test_export_to_a_read_only_file_system_is_refused_first(tmp_path, monkeypatch):
    from rlcore.cli.export import check_writable_target

    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):  # injected fault: the target's file system is mounted read-only
        if self == tmp_path / "model":
            raise OSError(errno.EROFS, "Read-only file system")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match="cannot be written \\(Read-only file system\\)"):
        check_writable_target(tmp_path / "model")
    monkeypatch.undo()
    check_writable_target(tmp_path / "model")
    assert not (tmp_path / "model").exists()  # checked, not left behind


@pytest.mark.parametrize("args, key", [(["--batch-size", "0"], "--batch-size"), (["--out", "."], "--out"),
                                       (["--out", "/proc/rlcore-eval.json"], "--out")])  # root may, but cannot create there
def test_eval_options_are_checked_before_evaluating(run_cli, tmp_path, args, key):
    done = run_cli("eval", str(tmp_path / "no-model"), str(tmp_path / "no-recipe.yaml"), *args, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert key in done.stderr and "no such directory" not in done.stderr  # refused before the model is even looked at


# ---- data files: huge rows in every format, encodings, lone surrogates --------------------------
def _write_rows(path: Path, rows: list[dict]) -> Path:
    import json

    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _preference(tiny_tokenizer, path: Path, **kw):
    from rlcore.data.preference.config import PreferenceDataConfig
    from rlcore.data.preference.data import build_preference_dataset

    return build_preference_dataset(PreferenceDataConfig(train_files=(str(path),), **kw), tiny_tokenizer)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_a_huge_preference_row_is_refused_before_parsing_naming_the_row(tiny_tokenizer, tmp_path, suffix):
    from rlcore.errors import DataError

    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 3
    rows.insert(1, {"prompt": "x" * (3 << 20), "chosen": "2", "rejected": "3"})
    path = _write_rows(tmp_path / f"pairs{suffix}", rows)
    with pytest.raises(DataError, match="data.max_row_bytes") as failure:
        _preference(tiny_tokenizer, path, max_row_bytes=1 << 20)
    assert str(path) in str(failure.value) and ("line 2" if suffix == ".jsonl" else "row 1") in str(failure.value)


@pytest.mark.parametrize("content, says", [
    (b'{"prompt": "caf\xe9", "chosen": "2", "rejected": "3"}\n', "line 1: byte 0xe9 is not UTF-8"),
    (b'{"prompt": "1+1=", "chosen": "\\ud800", "rejected": "3"}\n', "'chosen' holds a lone surrogate"),
])
def test_a_preference_file_that_cannot_be_tokenized_names_the_row(tiny_tokenizer, tmp_path, content, says):
    from rlcore.errors import DataError

    path = tmp_path / "pairs.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=says) as failure:
        _preference(tiny_tokenizer, path)
    assert str(path) in str(failure.value)


def test_the_group_size_check_leaves_the_runs_algorithm_untouched():
    """The check asks a copy for advantages: an algorithm that records its calls sees only the steps'."""
    from rlcore.algorithms.grpo import GRPO

    class Recording(GRPO):
        def __init__(self, config):
            super().__init__(config)
            self.seen = []

        def advantages(self, rewards_N, group_ids_N):
            self.seen.append(len(rewards_N))
            return super().advantages(rewards_N, group_ids_N)

    config, dataset, algorithm = _sized("train.num_prompts_per_step=4")
    recording = Recording(algorithm.config)
    check_run_sizes(config, dataset, recording)
    assert recording.seen == []
