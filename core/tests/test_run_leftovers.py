"""What a killed process leaves half-written in a run directory, and a full disk at the run's small files.

A run's outputs are written beside their place (``.NAME.tmp.PID``) and renamed there when whole
(:mod:`rlcore.config.run_paths`). A kill -9 mid-write leaves that copy: the next start (a resume, an
export) removes it, or completes a swap the kill cut between its two renames, and touches nothing
else. A full disk at ``run.json``, ``config.yaml``, ``summary.json``, ``curves.png`` or a record's
append is one error naming the file, its directory and the space free; what was there is kept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlcore.config.schema import CheckpointingConfig, LoggerConfig, PolicyConfig, RunConfig, TrainConfig
from rlcore.controller.run_dir import RUN_FILE, RunDir, write_run_config
from rlcore.config.run_paths import OutputWriteError, settle_leftovers

KILLED_MID_WRITE = """
import pathlib, sys, time
from rlcore.config.run_paths import replace_dir
def write(tmp):  # the final model's write, killed halfway
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    pathlib.Path(sys.argv[2]).touch()
    time.sleep(600)
replace_dir(pathlib.Path(sys.argv[1]), write, "the final model")
"""


def _config(log_dir: Path, **logger) -> RunConfig:
    return RunConfig(policy=PolicyConfig(model_name="models/tiny"), train=TrainConfig(max_num_steps=2),
                     logger=LoggerConfig(log_dir=str(log_dir), **logger), checkpointing=CheckpointingConfig(enabled=True))


def _killed_mid_write(final: Path, tmp_path: Path) -> int:
    """A process killed (SIGKILL) while it wrote ``final`` through replace_dir; returns its pid."""
    marker = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_MID_WRITE), str(final), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return proc.pid


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_final_model_write_killed_midway_is_removed_at_the_next_start_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "model").mkdir()
    (run / "model" / "model.safetensors").write_bytes(b"earlier")
    pid = _killed_mid_write(run / "model", tmp_path)
    assert (run / f".model.tmp.{pid}" / "model.safetensors").read_bytes() == b"half"
    alive = subprocess.Popen(["sleep", "60"])
    dead = _dead_pid()
    # not ours to remove: a live process's copy, names of another pattern or of a file the run does not write
    others = [f".model.tmp.{alive.pid}", ".model.tmp.x1", f"model.tmp.{dead}", f".notes.txt.tmp.{dead}", f".model.new.{dead}"]
    for name in others:
        (run / name).write_text("keep")
    try:
        owner = RunDir(_config(run)).open()
        owner.close()
    finally:
        alive.kill()
        alive.wait()
    assert sorted(p.name for p in run.iterdir()) == sorted([*others, "model", RUN_FILE, "run.lock"])
    assert (run / "model" / "model.safetensors").read_bytes() == b"earlier"


@pytest.mark.parametrize("cut", ["between_the_renames", "before_the_old_one_was_removed", "before_the_new_one_was_renamed"])
def test_a_swap_a_kill_cut_short_is_completed_or_undone(tmp_path, cut):
    """replace_dir renames ``model`` to ``.model.old.PID``, then ``.model.tmp.PID`` (whole by then) to
    ``model``, then removes the old one: a kill between any two leaves the newest whole model in place."""
    run, pid = tmp_path / "run", _dead_pid()
    run.mkdir()
    old, new = run / f".model.old.{pid}", run / ("model" if cut == "before_the_old_one_was_removed" else f".model.tmp.{pid}")
    if cut != "before_the_new_one_was_renamed":
        old.mkdir()
        (old / "weights").write_text("old")
    new.mkdir()
    (new / "weights").write_text("new")
    done = settle_leftovers(run, ["model"])
    expected = "old" if cut == "before_the_new_one_was_renamed" else "new"  # without the old one: the new one may be partial
    assert sorted(p.name for p in run.iterdir()) == ([] if expected == "old" else ["model"])
    if expected == "new":
        assert (run / "model" / "weights").read_text() == "new"
    assert done and all(str(pid) in line for line in done)


def test_export_completes_a_cut_swap_of_the_final_model_and_removes_its_own_leftovers(tiny_model_dir, tmp_path):
    """``rlcore export RUN_DIR OUT``: the run's model whose swap a kill cut is put back first; a killed
    earlier export's copy beside OUT is removed by the next export to OUT."""
    import shutil

    from rlcore.cli.export import export_checkpoint

    run, pid = tmp_path / "run", _dead_pid()
    run.mkdir()
    shutil.copytree(tiny_model_dir, run / f".model.tmp.{pid}")
    (run / f".model.old.{pid}").mkdir()
    (tmp_path / f".out.tmp.{pid}").mkdir()
    (tmp_path / f".out.tmp.{pid}" / "config.json").write_text("{}")
    done = export_checkpoint(run, tmp_path / "out")
    assert done["checkpoint"] == str(run / "model")
    assert sorted(p.name for p in run.iterdir()) == ["model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


# ---- a full disk at the run's small files -------------------------------------------------------
def _fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte; returns the filler (remove it to free the space)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def _assert_one_line(error: OutputWriteError, path: Path) -> None:
    message = str(error)
    assert "\n" not in message and message.startswith("no space left on device: "), message
    assert f"written to {path} " in message and f"MiB free in {path.parent})" in message, message


def test_run_json_on_a_full_disk_is_named_and_the_earlier_one_kept(small_disk):
    run = small_disk / "run"
    run.mkdir()
    (run / RUN_FILE).write_text('{"earlier": true}')
    _fill(small_disk)
    with pytest.raises(OutputWriteError) as failure:
        RunDir(_config(run)).open()
    _assert_one_line(failure.value, run / RUN_FILE)
    assert "the earlier run.json is kept" in str(failure.value)
    assert (run / RUN_FILE).read_text() == '{"earlier": true}'
    assert not [p.name for p in run.iterdir() if ".tmp." in p.name]


@pytest.mark.parametrize("name", ["config.yaml", "summary.json", "curves.png"])
def test_the_runs_small_files_on_a_full_disk_are_named_and_the_earlier_ones_kept(small_disk, name):
    from rlcore.controller.run_end import plot_curves
    from rlcore.controller.run_end import write_summary

    run = small_disk / "run"
    run.mkdir()
    (run / name).write_text("earlier")
    write = {"config.yaml": lambda: write_run_config(_config(run)),
             "summary.json": lambda: write_summary(run, {"steps": 2, "stopped_by_signal": None}),
             "curves.png": lambda: plot_curves([{"step": 1, "train/reward_mean": 0.5}], run / name)}[name]
    filler = _fill(small_disk)
    with pytest.raises(OutputWriteError) as failure:
        write()
    _assert_one_line(failure.value, run / name)
    assert (run / name).read_text() == "earlier"
    assert sorted(p.name for p in run.iterdir()) == [name]
    filler.unlink()
    write()  # with space, the same write replaces it whole
    assert (run / name).read_bytes() != b"earlier" and (run / name).stat().st_size > 0


@pytest.mark.parametrize("records", ["metrics", "rollout traces"])
def test_a_record_on_a_full_disk_is_named_and_the_file_keeps_whole_records(small_disk, records):
    from rlcore.loggers.config import JsonlLoggerConfig
    from rlcore.loggers.jsonl import JsonlLogger
    from rlcore.config.run_paths import append_whole

    run = small_disk / "run"
    run.mkdir()
    if records == "metrics":
        logger = JsonlLogger(JsonlLoggerConfig(), run)
        path, append, close = run / "metrics.jsonl", lambda step: logger.log({"loss": 0.5}, step), logger.close
    else:  # the traces' append (RolloutTraces._append) goes through the same call
        path = run / "rollouts.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        append = lambda step: append_whole(fd, (json.dumps({"step": step, "x": "y" * 100}) + "\n").encode(), path,  # noqa: E731
                                           f"the rollout traces of step {step}")
        close = lambda: os.close(fd)  # noqa: E731
    try:
        append(1)
        _fill(small_disk)
        with pytest.raises(OutputWriteError) as failure:
            for step in range(2, 1000):  # the file's last page may have room left: some records still fit
                append(step)
    finally:
        close()  # the file system unmounts only once nothing holds a file open
    _assert_one_line(failure.value, path)
    assert "every earlier record whole" in str(failure.value)
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))


def test_rlcore_run_on_a_full_disk_is_one_line_before_anything_loads(small_disk, tmp_path):
    _fill(small_disk)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"policy": {"model_name": str(tmp_path / "no-model")}, "train": {"max_num_steps": 1},
                                  "logger": {"log_dir": str(small_disk / "run")}}))
    done = subprocess.run([sys.executable, "-m", "rlcore.cli", "run", str(recipe)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: no space left on device: the run's identity could not be "
                                                     f"written to {small_disk / 'run' / RUN_FILE}"), done.stderr[-3000:]
