"""Runs that cannot hurt the user, end to end on CPU (fsdp2 backend, hf generator, math env):
checkpoints tied to their run, one writer per run directory, no code run from a checkpoint on
resume, hung environments bounded by cluster.timeout_s."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from test_loop import preloaded_runs, run_recipe, run_rlcore, run_script, tiny_recipe  # noqa: F401 - preloaded_runs: autouse here too

pytestmark = pytest.mark.slow


def _recipe(model_dir: Path, run_dir: Path, **extra) -> dict:
    recipe = tiny_recipe(model_dir, run_dir, **{"train.max_num_steps": 2, "train.val_period": 0, **extra})
    if "checkpointing.checkpoint_dir" not in extra:
        del recipe["checkpointing"]["checkpoint_dir"]  # the default: under logger.log_dir
    return recipe


@pytest.fixture(scope="module")
def checkpointed_run(tiny_model_dir, tmp_path_factory) -> tuple[dict, Path, subprocess.CompletedProcess]:
    """A finished two-step run with checkpoints in their default place (under logger.log_dir), shared by
    the two tests below: the runs they point at it refuse before writing anything there."""
    tmp = tmp_path_factory.mktemp("checkpointed")
    recipe = _recipe(tiny_model_dir, tmp / "a")
    return recipe, tmp, run_recipe(recipe, tmp)


def test_runs_with_other_settings_never_resume_each_other(checkpointed_run, tiny_model_dir):
    _, tmp_path, first = checkpointed_run
    assert first.returncode == 0, first.stderr[-3000:]
    assert "training backend: fsdp2 (policy.dtensor_cfg)" in first.stdout
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    other = run_recipe(_recipe(tiny_model_dir, tmp_path / "b", **{"train.seed": 4}), tmp_path)
    assert other.returncode == 0, other.stderr[-3000:]
    assert "resumed from" not in other.stdout
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["steps"] == 2
    shared = run_recipe(_recipe(tiny_model_dir, tmp_path / "c", **{"train.seed": 4, "checkpointing.checkpoint_dir":
                                                                    str(tmp_path / "a" / "checkpoints")}), tmp_path)
    assert shared.returncode != 0
    assert "train.seed" in shared.stderr and str(tmp_path / "a") in shared.stderr and str(tmp_path / "c") in shared.stderr
    assert not (tmp_path / "c" / "metrics.jsonl").exists() or not (tmp_path / "c" / "metrics.jsonl").read_text()


def _cli(recipe: dict, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    path = tmp / f"recipe-{os.urandom(3).hex()}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return run_rlcore(["run", str(path), *args], tmp)


def test_the_same_command_twice_refuses_rather_than_appending(tiny_model_dir, tmp_path):
    recipe = _recipe(tiny_model_dir, tmp_path / "run", **{"checkpointing.enabled": False})
    assert _cli(recipe, tmp_path).returncode == 0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = _cli(recipe, tmp_path)
    assert again.returncode == 2 and "logger.log_dir" in again.stderr and "already holds" in again.stderr, again.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    records = [json.loads(line) for line in metrics.splitlines()]
    assert [r["step"] for r in records] == [1, 2] and len({r["run_id"] for r in records}) == 1


def test_no_resume_flag_on_a_checkpointed_run_refuses(checkpointed_run):
    recipe, tmp_path, first = checkpointed_run
    assert first.returncode == 0, first.stderr[-3000:]
    again = _cli(recipe, tmp_path, "--no-resume")
    assert again.returncode == 2 and "checkpointing.resume is false" in again.stderr, again.stderr[-2000:]


@pytest.mark.parametrize("loop", ["grpo", "dpo", "sft"])
def test_a_users_directories_in_the_checkpoints_directory_are_refused_not_deleted(tiny_model_dir, tmp_path, loop):
    from test_offline_loops import pair_recipe, sft_recipe

    ckpt = tmp_path / "ckpt"
    for step in (1, 2):  # a user's own directories, no checkpoint in them
        (ckpt / f"step_00000{step}").mkdir(parents=True)
        (ckpt / f"step_00000{step}" / "notes.txt").write_text(f"notes {step}")
    if loop == "grpo":
        recipe = _recipe(tiny_model_dir, tmp_path / "run", **{"checkpointing.checkpoint_dir": str(ckpt)})
    else:
        recipe = (pair_recipe("dpo_tiny_cpu.yaml", tiny_model_dir, tmp_path / "run") if loop == "dpo"
                  else sft_recipe(tiny_model_dir, tmp_path / "run"))
        recipe["checkpointing"].update(checkpoint_dir=str(ckpt), save_period=1)
    done = _cli(recipe, tmp_path)
    assert done.returncode == 2 and "checkpointing.checkpoint_dir" in done.stderr, done.stderr[-2000:]
    assert str(ckpt / "step_000001") in done.stderr and "not rlcore checkpoints" in done.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000001", "step_000002"]
    assert [(p / "notes.txt").read_text() for p in sorted(ckpt.iterdir())] == ["notes 1", "notes 2"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# What each case plants in the run directory (or beside it), the override it runs with, the key its
# one-line refusal names. Each is refused before the model loads, and nothing outside is touched.
ESCAPES = {
    "dir_link_out": ({"sub": "../other_run"}, {"logger.jsonl.filename": "sub/metrics.jsonl"}, "logger.jsonl.filename"),
    "file_link_out": ({"metrics.jsonl": "../other_run/metrics.jsonl"}, {}, "logger.jsonl.filename"),
    "traces_link_out": ({"sub": "../other_run"}, {"logger.rollouts.filename": "sub/metrics.jsonl"}, "logger.rollouts.filename"),
    "control_file": ({}, {"logger.jsonl.filename": "run.json"}, "logger.jsonl.filename"),
    "the_dir_itself": ({}, {"logger.jsonl.filename": "."}, "logger.jsonl.filename"),
    "model_link_out": ({"model": "../other_run"}, {}, "logger.log_dir"),
    "checkpoints_link_out": ({"checkpoints": "../other_run"}, {"checkpointing.enabled": True}, "checkpointing.checkpoint_dir"),
    "lock_link_out": ({"run.lock": "../other_run/metrics.jsonl"}, {}, "logger.log_dir"),
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_no_write_of_a_run_follows_a_link_out_of_its_directory(tiny_model_dir, tmp_path, case):
    links, overrides, key = ESCAPES[case]
    other = tmp_path / "other_run"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1, "run_id": "other"}\n')
    run = tmp_path / "run"
    run.mkdir()
    for name, target in links.items():
        (run / name).symlink_to(target)
    done = _cli(_recipe(tiny_model_dir, run, **{"checkpointing.enabled": False, **overrides}), tmp_path)
    assert done.returncode == 2 and key in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) <= 3, done.stderr  # one message, no traceback
    assert sorted(p.name for p in other.iterdir()) == ["metrics.jsonl"]
    assert (other / "metrics.jsonl").read_text() == '{"step": 1, "run_id": "other"}\n'


def test_a_metrics_file_of_any_name_keeps_the_duplicate_records_guard(tiny_model_dir, tmp_path):
    """A run killed after its second record (no summary.json yet) left metrics.log; running the
    same command again must not append a second run's records to it."""
    run = tmp_path / "run"
    run.mkdir()
    left = "".join(json.dumps({"step": s, "run_id": "first"}) + "\n" for s in (1, 2))
    (run / "metrics.log").write_text(left)
    done = _cli(_recipe(tiny_model_dir, run, **{"checkpointing.enabled": False, "logger.jsonl.filename": "metrics.log"}),
                tmp_path)
    assert done.returncode == 2 and "already holds the records" in done.stderr, done.stderr[-2000:]
    assert (run / "metrics.log").read_text() == left


@pytest.mark.parametrize("loop", ["grpo", "dpo"])
def test_a_full_disk_at_the_final_model_is_one_line_and_leaves_no_part(tiny_model_dir, tmp_path, small_disk, loop):
    from test_offline_loops import pair_recipe

    run = small_disk / "run"
    if loop == "grpo":
        recipe = _recipe(tiny_model_dir, run, **{"checkpointing.enabled": False, "train.max_num_steps": 1})
    else:
        recipe = pair_recipe("dpo_tiny_cpu.yaml", tiny_model_dir, run)
        recipe["train"].update(max_num_steps=1, val_at_start=False, val_period=0)
        recipe["checkpointing"]["enabled"] = False
    done = _cli(recipe, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "no space left on device" in error[0] and str(run / "model") in error[0] and "MiB free" in error[0]
    assert not [p.name for p in run.iterdir() if "model" in p.name]  # no empty model/, no partial copy
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.fixture(scope="module")
def fsdp2_backend(single_process_group, tiny_model_dir):
    from rlcore.config.schema import PolicyConfig, RunConfig
    from rlcore.interfaces import WorldInfo
    from rlcore.plugins import get_plugin_manager

    reg = get_plugin_manager().get("training_backend", "fsdp2")
    config = RunConfig(policy=PolicyConfig(model_name=str(tiny_model_dir), precision="float32"),
                       sections={reg.section: reg.config_cls(enabled=True)})
    backend = reg.build(config, config.section(reg.section), WorldInfo())
    yield backend
    backend.shutdown()


def _loop_state(step: int) -> dict:
    from rlcore.controller.checkpoint import rng_state

    return {"step": step, "data_position": 4 * step, "records": [{"step": step}], "rng": rng_state(), "run": {"run_id": "r"}}


def _resume(root: Path, backend):
    from rlcore.controller.checkpoint import CheckpointManager

    return CheckpointManager(root, 3).resume(lambda path, state: None, lambda path: backend.load_checkpoint(str(path)))


def test_resume_runs_no_code_planted_in_any_checkpoint_file(fsdp2_backend, tmp_path):
    """Every file a resume reads (loop state, DCP metadata and data, the backend's JSON), through
    the same CheckpointManager.resume the loop calls, with the real fsdp2 backend."""
    from rlcore.controller.checkpoint import OWNER, CheckpointManager
    from rlcore.testing.planting import files_under, plant

    backend = fsdp2_backend
    saved = CheckpointManager(tmp_path / "saved", 2).save(1, backend.save_checkpoint, _loop_state(1))
    files = [p for p in files_under(saved) if p.name != OWNER]  # the writer's run id, plain text resume never reads
    assert {p.name for p in files} >= {"loop_state.pt", ".metadata", "__0_0.distcp"}
    for i, original in enumerate(files):
        root, marker = tmp_path / f"planted{i}", tmp_path / f"ran{i}"
        shutil.copytree(saved.parent, root)
        planted = root / original.relative_to(saved.parent)
        plant(planted, marker)
        with pytest.raises(Exception) as failure:
            _resume(root, backend)
        assert not marker.exists(), f"resume ran code planted in {planted}"
        assert planted.name in str(failure.value), (planted, failure.value)


@pytest.mark.parametrize("damaged", [".metadata", "__0_0.distcp", "loop_state.pt"])
def test_resume_falls_back_past_a_truncated_newest_checkpoint(fsdp2_backend, tmp_path, damaged, capsys):
    from rlcore.controller.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path, 3)
    for step in (1, 2):
        manager.save(step, fsdp2_backend.save_checkpoint, _loop_state(step))
    (victim,) = (tmp_path / "step_000002").rglob(damaged)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.warns(UserWarning, match=damaged):
        path, state = _resume(tmp_path, fsdp2_backend)
    assert path.name == "step_000001" and state["step"] == 1
    assert "skipped checkpoint" in capsys.readouterr().out


HUNG_RUN = """
import time, rlcore
from rlcore.interfaces import EnvStep
class Hung:
    def step(self, samples, responses):
        time.sleep(600)
        return [EnvStep(reward=1.0) for _ in samples]
if __name__ == "__main__":
    rlcore.run(rlcore.load_config({path!r}), environment=Hung())
"""


def _run_hung(template: str, model_dir: Path, tmp: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """A two-step run whose environment or generator (in ``template``) hangs, under ``cluster.timeout_s``."""
    path = tmp / "hung.yaml"
    recipe = _recipe(model_dir, tmp / "hung", **{"cluster.timeout_s": timeout_s, "checkpointing.enabled": False})
    path.write_text(yaml.safe_dump(recipe))
    return run_script(textwrap.dedent(template.format(path=str(path))), tmp, timeout=120)


@pytest.mark.wall_clock
def test_a_hung_environment_is_bounded_by_cluster_timeout(tiny_model_dir, tmp_path):
    # The limit bounds the real generation before it too (over 2 s seen on two busy cores): 8 s
    # leaves it four times that; the environment sleeps 600 s.
    done = _run_hung(HUNG_RUN, tiny_model_dir, tmp_path, timeout_s=8)
    assert done.returncode != 0
    assert "environment 'Hung' did not answer within 8s" in done.stderr and "step 1" in done.stderr, done.stderr[-3000:]


HUNG_GENERATOR_RUN = """
import time, rlcore
class HungGenerator:
    weights_version = 0
    def generate(self, prompts, params):
        time.sleep(60)
    def update_weights(self, named_tensors):
        pass
if __name__ == "__main__":
    rlcore.run(rlcore.load_config({path!r}), generator=HungGenerator())
"""


@pytest.mark.wall_clock
def test_a_hung_generator_is_bounded_by_cluster_timeout(tiny_model_dir, tmp_path):
    done = _run_hung(HUNG_GENERATOR_RUN, tiny_model_dir, tmp_path, timeout_s=2)
    assert done.returncode != 0
    assert "GenerationTimeout" in done.stderr and "'generate' did not finish within 2s" in done.stderr, done.stderr[-3000:]
    assert "at step 1" in done.stderr


HANGING_REWARDS = """
import time
def sleeps(prompts, completions, **kwargs):
    time.sleep(600)
    return [1.0] * len(completions)
def spins(prompts, completions, **kwargs):
    while True:
        pass
"""


@pytest.mark.wall_clock
@pytest.mark.parametrize("fn, mode", [("sleeps", "sync"), ("spins", "async")])
def test_a_reward_function_that_never_returns_stops_the_cli_run_in_one_line(tiny_model_dir, tmp_path, fn, mode):
    """``env.reward_fn`` that never returns: ``rlcore run`` stops at the first step's scoring, one line
    naming the function and the step (sync: the main thread's deadline; async: the scoring thread's,
    reported as the environment's, not the rollout thread's)."""
    (tmp_path / "hanging_rewards.py").write_text(HANGING_REWARDS)
    recipe = _recipe(tiny_model_dir, tmp_path / "run", **{"cluster.timeout_s": 8, "checkpointing.enabled": False,
                                                          "env.reward_fn": f"hanging_rewards:{fn}",
                                                          "grpo.async_grpo.enabled": mode == "async"})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    done = run_script(f"import sys; sys.path.insert(0, {str(tmp_path)!r})\nfrom rlcore.cli.commands import main\n"
                      f"sys.exit(main(['run', {str(path)!r}]))", tmp_path, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (f"error: EnvironmentTimeout: timeout: environment 'hanging_rewards:{fn}' did not answer within 8s "
            "(cluster.timeout_s) at step 1; set env.on_timeout=zero") in done.stderr, done.stderr[-3000:]
    assert "rollout thread" not in done.stderr


STUCK_AFTER_SIGTERM = """
import pathlib, time, rlcore
from rlcore.interfaces import EnvStep
class StuckAtStep2:  # as an environment whose process the group's SIGTERM ended: its call never returns
    calls = 0
    def step(self, samples, responses):
        StuckAtStep2.calls += 1
        if StuckAtStep2.calls == 2:
            pathlib.Path({marker!r}).touch()
            time.sleep(600)
        return [EnvStep(reward=1.0) for _ in samples]
class CloseHangs:  # and a logger whose close, at teardown, waits for it too
    def log(self, metrics, step):
        pass
    def close(self):
        time.sleep(600)
if __name__ == "__main__":
    rlcore.run(rlcore.load_config({path!r}), environment=StuckAtStep2(), loggers=[CloseHangs()])
"""


@pytest.mark.wall_clock
def test_a_run_stuck_after_sigterm_exits_within_cluster_timeout_keeping_its_checkpoint(tiny_model_dir, tmp_path):
    """SIGTERM while a call into a part the signal ended never returns, then a teardown that waits on
    it too: each is bounded by cluster.timeout_s on its own, but the process ends cluster.timeout_s
    after the signal, with 143, its stacks, and the checkpoint of the last finished step."""
    import signal
    import time

    marker, path = tmp_path / "stuck", tmp_path / "stuck.yaml"
    path.write_text(yaml.safe_dump(_recipe(tiny_model_dir, tmp_path / "run", **{"cluster.timeout_s": 6,
                                                                                 "train.max_num_steps": 4})))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STUCK_AFTER_SIGTERM.format(marker=str(marker), path=str(path)))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=60)
        ended_after = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert ended_after < 6 + 4, ended_after  # cluster.timeout_s after the signal, not one bounded wait after another
    assert "SIGTERM received 6s ago (cluster.timeout_s) and the run has not ended" in err, err[-3000:]
    assert "CloseHangs" in err or "close" in err  # the stacks: what it waited for
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "loop_state.pt").is_file()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_during_a_dcp_save_is_named_and_leaves_no_tmp(fsdp2_backend, tmp_path):
    """The backend's data file is /dev/full (writes fail with ENOSPC from the kernel)."""
    from rlcore.controller.checkpoint import CheckpointManager, CheckpointWriteError

    def save_onto_a_full_disk(path: str) -> None:
        Path(path).mkdir()
        (Path(path) / "__0_0.distcp").symlink_to("/dev/full")
        fsdp2_backend.save_checkpoint(path)

    with pytest.raises(CheckpointWriteError, match="no space left on device"):
        CheckpointManager(tmp_path, 2).save(1, save_onto_a_full_disk, _loop_state(1))
    assert list(tmp_path.iterdir()) == []


def test_sigterm_ends_the_step_checkpoints_it_and_the_run_resumes_from_it(tiny_model_dir, tmp_path):
    """A scheduler's SIGTERM (preemption, a time limit) costs no finished work: the run ends its
    step, checkpoints that step although save_period is far off, exits 143, and resumes there."""
    import signal
    import time

    run_dir = tmp_path / "run"
    recipe = _recipe(tiny_model_dir, run_dir, **{"train.max_num_steps": 60, "checkpointing.save_period": 1000})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = subprocess.Popen([sys.executable, "-m", "rlcore.cli", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    last = steps[-1]
    assert 1 <= last < 60 and steps == list(range(1, last + 1))
    assert f"SIGTERM received: stopped after step {last}, checkpoint of step {last}" in out, out[-2000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{last:06d}"]
    assert json.loads((run_dir / "summary.json").read_text())["stopped_by_signal"] == "SIGTERM"
    # What a kill between the checkpoint's rename and the metrics write leaves: the checkpoint of
    # step `last` without its line. The resume puts the record back from the checkpoint.
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:-1]))
    recipe["train"]["max_num_steps"] = last + 2
    resumed = _cli(recipe, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {last}" in resumed.stdout
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, last + 3)), "each step once, resumed after the signalled one"
    elapsed = [r["time/elapsed_s"] for r in lines]
    assert elapsed == sorted(elapsed), "wall time counts on across the resume"
