"""A run's files under faults and sharing: a kill between a checkpoint and its metrics line loses
no record, a lost ``run.json`` keeps the duplicate-records guard on, a shared checkpoints
directory never mixes or deletes another run's checkpoints, the metrics file stays in the run
directory, and export reads the config a checkpoint carries, never a path it names."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
import yaml

from rlcore.config import ConfigError
from rlcore.loading.loader import build_config
from rlcore.config.schema import CheckpointingConfig, LoggerConfig, OptimizerConfig, PolicyConfig, RunConfig, TrainConfig
from rlcore.controller.checkpoint import CheckpointManager, CheckpointWriteError, resume_loggers, rng_state
from rlcore.controller.run_dir import RUN_FILE, RunDir, check_owner, checkpoint_root
from rlcore.errors import CheckpointError
from rlcore.cli.export import run_config_for
from rlcore.loggers.config import JsonlLoggerConfig
from rlcore.loggers.jsonl import JsonlLogger


def _config(log_dir: Path, lr: float = 1e-6, steps: int = 4, **checkpointing) -> RunConfig:
    return RunConfig(policy=PolicyConfig(model_name="models/tiny", optimizer=OptimizerConfig(lr=lr)),
                     train=TrainConfig(max_num_steps=steps), logger=LoggerConfig(log_dir=str(log_dir)),
                     checkpointing=CheckpointingConfig(**checkpointing))


def _state(step: int, run_id: str, records: list[dict] | None = None) -> dict:
    return {"step": step, "data_position": 4 * step, "records": records or [], "rng": rng_state(),
            "run": {"run_id": run_id, "log_dir": "x", "fingerprint": {}}}


def _backend(path: str) -> None:
    Path(path).mkdir()
    torch.save({"w": torch.zeros(2)}, Path(path) / "weights.pt")


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


# ---- a step's record survives a kill between its checkpoint and its metrics line --------------
def test_resume_puts_back_the_record_the_checkpoint_holds_and_the_file_lacks(tmp_path):
    logger = JsonlLogger(JsonlLoggerConfig(), tmp_path)
    for step in (1, 2):
        logger.log({"loss": 0.5}, step)
    # killed after step 3's checkpoint was renamed into place, before its line was written
    checkpointed = [{"step": s, "loss": 0.5} for s in (1, 2, 3)]
    logger.log({"loss": 9.0}, 4)  # and a step after it, redone on resume
    resume_loggers([logger], 3, checkpointed)
    logger.log({"loss": 0.25}, 4)
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 0.5), (2, 0.5), (3, 0.5), (4, 0.25)]


def test_a_lost_run_json_does_not_turn_off_the_duplicate_records_guard(tmp_path):
    RunDir(_config(tmp_path)).open().close()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / RUN_FILE).unlink()
    with pytest.raises(ConfigError, match="already holds the records") as failure:
        RunDir(_config(tmp_path)).open()
    assert failure.value.key == "logger.log_dir" and "run.json is missing or unreadable" in str(failure.value)
    (tmp_path / RUN_FILE).write_text('{"run_id": "abc", "fingerp')  # cut short: unreadable
    with pytest.raises(ConfigError, match="already holds the records"):
        RunDir(_config(tmp_path)).open()


def test_a_lost_run_json_is_recovered_from_the_newest_checkpoint(tmp_path):
    config = _config(tmp_path, enabled=True)
    first = RunDir(config).open()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    CheckpointManager(checkpoint_root(config), 2).save(1, _backend, {**_state(1, first.run_id), "run": first.identity()})
    first.close()
    (tmp_path / RUN_FILE).unlink()
    again = RunDir(config).open()
    again.close()
    assert again.run_id == first.run_id
    assert json.loads((tmp_path / RUN_FILE).read_text())["run_id"] == first.run_id


# ---- a shared checkpoints directory ------------------------------------------------------------
def test_the_fingerprint_is_the_whole_config_but_what_a_resume_may_change(tmp_path):
    ours = RunDir(_config(tmp_path / "a", lr=1e-6, steps=4))
    with pytest.raises(ConfigError) as failure:
        check_owner(RunDir(_config(tmp_path / "b", lr=2e-6, steps=4)).identity(), ours.identity(), tmp_path / "step_000001")
    assert failure.value.key == "policy.optimizer.lr"
    longer = RunDir(_config(tmp_path / "a", steps=40, save_period=3, checkpoint_dir=str(tmp_path / "c")))
    check_owner(longer.identity(), ours.identity(), tmp_path / "step_000001")  # run longer, checkpoint elsewhere: same run


def test_two_runs_saving_one_step_never_delete_each_others_partial_checkpoint(tmp_path):
    a, b = CheckpointManager(tmp_path, 2), CheckpointManager(tmp_path, 2)
    seen: dict[str, bool] = {}

    def a_backend(path: str) -> None:
        _backend(path)
        b.save(1, _backend, _state(1, "run-b"))  # the other run saves its step 1 meanwhile
        seen["a's partial survived"] = Path(path).is_dir()

    with pytest.raises(CheckpointWriteError, match="belongs to run run-b") as failure:
        a.save(1, a_backend, _state(1, "run-a"))
    assert seen == {"a's partial survived": True}
    assert "checkpointing.checkpoint_dir" in str(failure.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert CheckpointManager.owner(tmp_path / "step_000001") == "run-b"


def test_saving_prunes_only_its_own_checkpoints(tmp_path):
    other = CheckpointManager(tmp_path, 1)
    other.save(7, _backend, _state(7, "run-b"))
    older = tmp_path / "step_000008"  # no owner file: written by an older rlcore, or by hand
    older.mkdir()
    (older / "loop_state.pt").write_bytes(b"")
    ours = CheckpointManager(tmp_path, 1)
    for step in (1, 2, 3):
        ours.save(step, _backend, _state(step, "run-a"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000007", "step_000008"]


def test_a_run_resumes_from_its_own_newest_checkpoint_past_another_runs_newer_ones(tmp_path, capsys):
    """Two runs (lr 1e-6 and 2e-6) checkpointing into one directory: the one behind resumes from its
    own step 3, not refused for the other's step 4; a run with none of its own there is refused."""
    shared = tmp_path / "shared"
    runs = {lr: {**RunDir(_config(tmp_path / str(lr), lr=lr, checkpoint_dir=str(shared))).identity(), "run_id": f"run-{lr}"}
            for lr in (1e-6, 2e-6, 3e-6)}
    behind, ahead = CheckpointManager(shared, 3), CheckpointManager(shared, 3)
    for step in (1, 2, 3):
        behind.save(step, _backend, {**_state(step, runs[1e-6]["run_id"]), "run": runs[1e-6]})
    ahead.save(4, _backend, {**_state(4, runs[2e-6]["run_id"]), "run": runs[2e-6]})
    found = behind.resume(lambda path, state: check_owner(state.get("run"), runs[1e-6], path), lambda path: None)
    assert found is not None and found[0].name == "step_000003" and found[1]["step"] == 3
    assert "1 newer checkpoint(s)" in capsys.readouterr().out
    with pytest.raises(ConfigError) as failure:  # none of these is the third run's
        behind.resume(lambda path, state: check_owner(state.get("run"), runs[3e-6], path), lambda path: None)
    assert failure.value.key == "policy.optimizer.lr" and "step_000004" in str(failure.value)
    with pytest.raises(CheckpointWriteError, match=r"move its own checkpoints \(step_000001, step_000002, step_000003\)"):
        behind.save(4, _backend, {**_state(4, runs[1e-6]["run_id"]), "run": runs[1e-6]})


def _user_dirs(root: Path) -> dict[str, str]:
    """A user's own ``step_N`` directories (no checkpoint in them), as the issue's report had them."""
    for step in (1, 2):
        (root / f"step_00000{step}").mkdir(parents=True)
        (root / f"step_00000{step}" / "notes.txt").write_text(f"notes {step}")
    return {p.name: (p / "notes.txt").read_text() for p in root.iterdir()}


def _left(root: Path) -> dict[str, str]:
    return {p.name: (p / "notes.txt").read_text() for p in root.iterdir() if (p / "notes.txt").exists()}


def test_saving_never_replaces_a_directory_that_is_no_checkpoint_of_this_run(tmp_path):
    before = _user_dirs(tmp_path)
    with pytest.raises(CheckpointWriteError, match="no rlcore owner file") as failure:
        CheckpointManager(tmp_path, 1).save(1, _backend, _state(1, "run-a"))
    assert str(tmp_path / "step_000001") in str(failure.value) and "checkpointing.checkpoint_dir" in str(failure.value)
    assert _left(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_saving_and_pruning_never_follow_a_link_out_of_the_checkpoints_directory(tmp_path, outside_dir, kind):
    root, outside = tmp_path / "ckpt", outside_dir
    root.mkdir()
    target = outside / "keep.txt"
    if kind == "dir":  # a whole checkpoint of this run, linked in from elsewhere
        CheckpointManager(outside, 1).save(1, _backend, _state(1, "run-a"))
        target = outside / "step_000001"
    (root / "step_000001").symlink_to(target)
    listing = sorted(str(p) for p in outside.rglob("*"))
    ours = CheckpointManager(root, 1)
    with pytest.raises(CheckpointWriteError, match="a symbolic link"):
        ours.save(1, _backend, _state(1, "run-a"))
    for step in (2, 3):  # pruning keeps one: step_000001 is a link, never ours to delete
        ours.save(step, _backend, _state(step, "run-a"))
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000003"]
    assert (root / "step_000001").is_symlink() and sorted(str(p) for p in outside.rglob("*")) == listing


def test_a_leftover_partial_checkpoint_that_is_a_link_is_unlinked_not_followed(tmp_path, outside_dir):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step_000001.tmp.run-a").symlink_to(outside_dir)
    CheckpointManager(tmp_path / "ckpt", 1).save(1, _backend, _state(1, "run-a"))
    assert sorted(p.name for p in outside_dir.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000001"]


def test_a_run_refuses_at_the_start_a_checkpoint_place_that_holds_a_users_directory(tmp_path):
    before = _user_dirs(tmp_path / "ckpt")
    config = _config(tmp_path / "run", steps=4, enabled=True, save_period=2, checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match="not rlcore checkpoints") as failure:
        RunDir(config).open()
    assert failure.value.key == "checkpointing.checkpoint_dir" and str(tmp_path / "ckpt" / "step_000002") in str(failure.value)
    assert str(tmp_path / "ckpt" / "step_000001") not in str(failure.value)  # step 1 is never saved with save_period 2
    assert _left(tmp_path / "ckpt") == before and not (tmp_path / "run" / RUN_FILE).exists()
    RunDir(_config(tmp_path / "other", steps=1, enabled=True, save_period=1, checkpoint_dir=str(tmp_path / "elsewhere"))).open().close()


# ---- files of one run stay in its directory -----------------------------------------------------
@pytest.mark.parametrize("name", ["../other/metrics.jsonl", "/tmp/metrics.jsonl", "a/../../m.jsonl", "", ".", "sub/.",
                                  "run.json", "run.lock", "config.yaml", "summary.json", "model/metrics.jsonl",
                                  "checkpoints/m.jsonl"])
@pytest.mark.parametrize("section", ["jsonl", "rollouts"])  # the metrics file, the rollout traces' file
def test_the_metrics_file_stays_in_the_log_dir(name, section):
    with pytest.raises(ConfigError, match="inside logger.log_dir") as failure:
        build_config({"policy": {"model_name": "m"}, "logger": {section: {"filename": name}}})
    assert failure.value.key == f"logger.{section}.filename"
    assert JsonlLoggerConfig(filename="sub/metrics.jsonl").filename == "sub/metrics.jsonl"


def _logged(tmp_path: Path, **logger) -> RunConfig:
    return build_config({"policy": {"model_name": "m"}, "logger": {"log_dir": str(tmp_path / "run"), **logger}})


def test_the_rollout_traces_file_keeps_every_guard_of_the_metrics_file(tmp_path, outside_dir):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "sub").symlink_to(outside_dir)
    with pytest.raises(ConfigError, match="leads out of the run directory") as failure:
        RunDir(_logged(tmp_path, rollouts={"filename": "sub/traces.jsonl"})).open()
    assert failure.value.key == "logger.rollouts.filename"
    with pytest.raises(ConfigError, match="one file") as failure:
        RunDir(_logged(tmp_path, rollouts={"filename": "m.log"}, jsonl={"filename": "m.log"})).open()
    (tmp_path / "run" / "traces.log").write_text('{"step": 1}\n')  # a killed run's traces, under another name
    with pytest.raises(ConfigError, match="already holds the records"):
        RunDir(_logged(tmp_path, rollouts={"filename": "traces.log"})).open()
    RunDir(_logged(tmp_path)).open().close()  # the defaults: nothing there of theirs
    assert sorted(p.name for p in outside_dir.iterdir()) == ["keep.txt"]


def test_the_rollout_traces_writer_refuses_a_link_out_when_it_opens_its_file(tmp_path, outside_dir):
    from rlcore.config.traces import RolloutTracesConfig
    from rlcore.loggers.traces import RolloutTraces

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rollouts.jsonl").symlink_to(outside_dir / "keep.txt")
    with pytest.raises(ConfigError, match="leads out of the run directory") as failure:
        RolloutTraces(RolloutTracesConfig(), tmp_path / "run")._open()
    assert failure.value.key == "logger.rollouts.filename" and (outside_dir / "keep.txt").read_text() == "keep me"


def test_a_link_inside_the_run_directory_is_written_through(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "metrics.jsonl").symlink_to("logs/metrics.jsonl")
    logger = JsonlLogger(JsonlLoggerConfig(), tmp_path)
    logger.log({"loss": 0.5}, 1)
    logger.close()
    assert _steps(tmp_path / "logs" / "metrics.jsonl") == [1]


def test_export_reads_the_config_the_checkpoint_carries_never_a_path_it_names(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.yaml").write_text(yaml.safe_dump({"policy": {"model_name": "the-victims-model"}}))
    crafted = tmp_path / "copied" / "step_000001"
    CheckpointManager(crafted.parent, 1).save(1, _backend, {**_state(1, "r"), "run": {"run_id": "r", "log_dir": str(victim)}})
    with pytest.raises(CheckpointError, match="carries none"):
        run_config_for(crafted)
    owner = RunDir(_config(tmp_path / "run"))
    CheckpointManager(tmp_path / "own", 1).save(1, _backend, {**_state(1, "r"), "run": owner.identity()})
    config = run_config_for(tmp_path / "own" / "step_000001", ["policy.model_name=moved"])
    assert config.policy.model_name == "moved" and config.logger.log_dir == str(tmp_path / "run")


def test_a_loop_state_missing_a_key_is_named_as_damage(tmp_path):
    manager = CheckpointManager(tmp_path, 2)
    state = _state(1, "r")
    del state["data_position"]
    manager.save(1, _backend, state)
    with pytest.raises(CheckpointError, match="no usable checkpoint.*has no 'data_position'"), pytest.warns(UserWarning):
        manager.resume(lambda path, s: None, lambda path: None)


# ---- a checkpoint of an older rlcore, which kept the keys every trainer reads under grpo -------
def _as_written_before_the_train_section(identity: dict) -> dict:
    """``identity`` as an rlcore that kept train.* under grpo.* wrote it: its config and fingerprint."""
    config = yaml.safe_load(identity["config"])
    config["grpo"] = {**config.pop("train"), **config["grpo"]}
    fingerprint = {("grpo." + key[len("train."):] if key.startswith("train.") else key): value
                   for key, value in identity["fingerprint"].items()}
    return {**identity, "config": yaml.safe_dump(config), "fingerprint": fingerprint}


def test_an_older_checkpoint_with_grpo_step_keys_exports_and_resumes_as_the_same_run(tmp_path):
    owner = RunDir(_config(tmp_path / "run", steps=7))
    older = _as_written_before_the_train_section(owner.identity())
    assert "grpo.seed" in older["fingerprint"] and "train.seed" not in older["fingerprint"]
    with pytest.raises(ConfigError, match="grpo.max_num_steps -> train.max_num_steps"):  # never read as a recipe
        build_config(yaml.safe_load(older["config"]))
    CheckpointManager(tmp_path / "old", 1).save(1, _backend, {**_state(1, "r"), "run": older})
    config = run_config_for(tmp_path / "old" / "step_000001")
    assert config.train.max_num_steps == 7 and config.train.seed == owner.config.train.seed
    check_owner(older, owner.identity(), tmp_path / "old")  # the same settings, spelled anew: resumable
    reseeded = RunDir(attrs.evolve(owner.config, train=attrs.evolve(owner.config.train, seed=5)))
    with pytest.raises(ConfigError, match="which had train.seed=42") as failure:
        check_owner(older, reseeded.identity(), tmp_path / "old")
    assert failure.value.key == "train.seed"


@pytest.mark.parametrize("logger", ["jsonl", "tensorboard"])
def test_each_logger_refuses_a_link_out_of_the_run_directory_when_it_writes(tmp_path, outside_dir, logger):
    """The run's start checks every output (tests/test_run_safety.py); each writer checks again
    where it writes (a link made after the start)."""
    run = tmp_path / "run"
    run.mkdir()
    if logger == "jsonl":
        (run / "sub").symlink_to(outside_dir)
        with pytest.raises(ConfigError, match="leads out of the run directory") as failure:
            JsonlLogger(JsonlLoggerConfig(filename="sub/metrics.jsonl"), run)
        assert failure.value.key == "logger.jsonl.filename"
    else:
        pytest.importorskip("tensorboard")
        from rlcore.loggers.config import TensorboardLoggerConfig
        from rlcore.loggers.tensorboard import TensorboardLogger

        (run / "tensorboard").symlink_to(outside_dir)
        with pytest.raises(ConfigError, match="leads out of the run directory") as failure:
            TensorboardLogger(TensorboardLoggerConfig(enabled=True), run)
        assert failure.value.key == "logger.tensorboard.enabled"
    assert sorted(p.name for p in outside_dir.iterdir()) == ["keep.txt"]


def test_a_link_out_is_refused_only_where_the_run_would_write(tmp_path, outside_dir):
    from rlcore.loggers.config import TensorboardLoggerConfig

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tensorboard").symlink_to(outside_dir)
    RunDir(_config(tmp_path / "run")).open().close()  # tensorboard off: the link is none of the run's business
    config = attrs.evolve(_config(tmp_path / "run"), sections={"logger.tensorboard": TensorboardLoggerConfig(enabled=True)})
    with pytest.raises(ConfigError, match="leads out of the run directory") as failure:
        RunDir(config).open()
    assert failure.value.key == "logger.tensorboard.enabled"
