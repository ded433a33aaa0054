"""One run per run directory: a lock naming its holder, refusal to mix a second run's records
into a first's, checkpoints tied to the run by a fingerprint, run ids in line-atomic metrics."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlcore.cli.commands import build_parser, run_overrides
from rlcore.config import ConfigError
from rlcore.config.schema import CheckpointingConfig, LoggerConfig, PolicyConfig, RunConfig, TrainConfig
from rlcore.controller.checkpoint import CheckpointManager, rng_state
from rlcore.controller.run_dir import RunDir, check_owner, checkpoint_root
from rlcore.loggers.config import JsonlLoggerConfig
from rlcore.loggers.jsonl import JsonlLogger
from rlcore.config.run_paths import OutputWriteError


def _config(log_dir: Path, seed: int = 1, **checkpointing) -> RunConfig:
    return RunConfig(policy=PolicyConfig(model_name="models/tiny"), train=TrainConfig(seed=seed),
                     logger=LoggerConfig(log_dir=str(log_dir)), checkpointing=CheckpointingConfig(**checkpointing))


def test_checkpoints_default_to_the_runs_own_directory(tmp_path):
    assert checkpoint_root(_config(tmp_path / "a")) == tmp_path / "a" / "checkpoints"
    assert checkpoint_root(_config(tmp_path / "a", checkpoint_dir=str(tmp_path / "c"))) == tmp_path / "c"


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    first = RunDir(_config(tmp_path)).open()
    try:
        with pytest.raises(ConfigError) as failure:
            RunDir(_config(tmp_path)).open()
        assert failure.value.key == "logger.log_dir" and f"pid {os.getpid()}" in str(failure.value)
    finally:
        first.close()
    RunDir(_config(tmp_path)).open().close()  # released: the next run may start


def test_the_lock_dies_with_its_process(tmp_path):
    """A killed run never blocks its own resume: flock is released by the kernel."""
    code = textwrap.dedent(f"""
        import os
        from rlcore.config.schema import LoggerConfig, PolicyConfig, RunConfig
        from rlcore.controller.run_dir import RunDir
        RunDir(RunConfig(policy=PolicyConfig(model_name="m"), logger=LoggerConfig(log_dir={str(tmp_path)!r}))).open()
        os._exit(9)
    """)
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 9
    RunDir(_config(tmp_path)).open().close()


def test_rerun_without_resume_refuses_and_keeps_the_records(tmp_path):
    owner = RunDir(_config(tmp_path)).open()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    owner.close()
    with pytest.raises(ConfigError) as failure:
        RunDir(_config(tmp_path)).open()
    assert failure.value.key == "logger.log_dir" and owner.run_id in str(failure.value)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_resumable_rerun_keeps_the_run_id(tmp_path):
    config = _config(tmp_path, enabled=True)
    owner = RunDir(config).open()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    CheckpointManager(checkpoint_root(config), 2).save(1, lambda p: Path(p).mkdir(), {"step": 1, "rng": rng_state()})
    owner.close()
    again = RunDir(config).open()
    again.close()
    assert again.run_id == owner.run_id


def test_a_rerun_with_other_settings_in_the_same_directory_is_refused(tmp_path):
    config = _config(tmp_path, seed=1, enabled=True)
    owner = RunDir(config).open()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    CheckpointManager(checkpoint_root(config), 2).save(1, lambda p: Path(p).mkdir(), {"step": 1, "rng": rng_state()})
    owner.close()
    with pytest.raises(ConfigError) as failure:
        RunDir(_config(tmp_path, seed=2, enabled=True)).open()
    assert failure.value.key == "train.seed" and owner.run_id in str(failure.value)
    assert "choose another logger.log_dir" in str(failure.value)


def test_another_runs_checkpoint_is_refused_naming_both_runs_and_the_key(tmp_path):
    ours = RunDir(_config(tmp_path / "b", seed=2))
    theirs = {"run_id": "20260101-000000-abcdef", "log_dir": str(tmp_path / "a"),
              "fingerprint": RunDir(_config(tmp_path / "a", seed=1)).fingerprint}
    with pytest.raises(ConfigError) as failure:
        check_owner(theirs, ours.identity(), tmp_path / "ckpt" / "step_000003")
    message = str(failure.value)
    assert failure.value.key == "train.seed"
    assert "20260101-000000-abcdef" in message and str(tmp_path / "a") in message and str(tmp_path / "b") in message
    assert "--no-resume" in message
    check_owner({**theirs, "fingerprint": ours.fingerprint}, ours.identity(), tmp_path)  # same settings: accepted


def test_metrics_records_carry_the_run_id_and_resume_drops_redone_steps(tmp_path):
    owner = RunDir(_config(tmp_path)).open()
    logger = JsonlLogger(JsonlLoggerConfig(), tmp_path)
    for step in (1, 2, 3):
        logger.log({"loss": 0.5}, step)
    logger.resume_at(2)
    logger.log({"loss": 0.25}, 3)
    logger.close()
    owner.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 0.5), (2, 0.5), (3, 0.25)]
    assert {r["run_id"] for r in records} == {owner.run_id}


def test_a_metrics_write_cut_short_by_a_full_disk_leaves_whole_records(tmp_path, monkeypatch):
    logger = JsonlLogger(JsonlLoggerConfig(), tmp_path)
    logger.log({"loss": 1.0}, 1)
    real_write = os.write

    def full_disk(fd, data):  # injected fault: the disk fills during this record's write
        if fd != logger._fd:
            return real_write(fd, data)
        real_write(fd, data[:7])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OutputWriteError, match="no space left on device") as failure:
        logger.log({"loss": 2.0}, 2)
    monkeypatch.undo()
    assert "metrics.jsonl" in str(failure.value) and "step 2" in str(failure.value) and "MiB free in" in str(failure.value)
    logger.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_cli_resume_flags_override_the_recipe():
    parser = build_parser()
    assert run_overrides(parser.parse_args(["run", "r.yaml", "a.b=1", "--no-resume"])) == ["a.b=1", "checkpointing.resume=false"]
    assert run_overrides(parser.parse_args(["run", "r.yaml", "--resume"])) == ["checkpointing.resume=true"]
    assert run_overrides(parser.parse_args(["run", "r.yaml"])) == []


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlcore.loggers.config import TensorboardLoggerConfig
    from rlcore.loggers.tensorboard import TensorboardLogger

    logger = TensorboardLogger(TensorboardLoggerConfig(enabled=True), tmp_path)
    for step in (1, 2, 3):
        logger.log({"loss": float(step)}, step)
    logger.resume_at(2)
    logger.log({"loss": 30.0}, 3)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), purge_orphaned_data=True)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
