"""The run loop end to end on CPU with real parts: fsdp2 backend, hf generator, math env.

vLLM runs are covered by the demo and by tests/test_loop_vllm.py; here the built-in ``hf``
generator keeps each run to seconds so resume, async and failure handling can be tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from _preloaded_cli import PreloadedCli

from rlcore.config.structure import set_dotted
from rlcore.testing.faults import fault_env

pytestmark = pytest.mark.slow

TIMING_PREFIXES = ("timing/", "time/", "refit/seconds", "refit/gb_per_s", "train/seconds", "run_id", "async/generator_idle_s",
                   "async/generator_waits_for_trainer_s", "async/generator_start_s", "async/batch_wait_s", "refit/generator_hold_s",
                   "async/refit_after_generation_s", "async/generator_wake_after_")


def tiny_recipe(model_dir: Path, run_dir: Path, **extra) -> dict:
    recipe = {
        "policy": {
            "model_name": str(model_dir), "precision": "float32", "max_total_sequence_length": 48,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True},
            "generation": {"backend": "hf", "max_new_tokens": 3, "temperature": 1.0},
        },
        "algorithm": {"name": "grpo"},
        "data": {"name": "arithmetic", "digits": 1, "num_validation": 8, "num_train": 64},
        "env": {"name": "math", "math": {"executor": "inline"}},
        "train": {"num_prompts_per_step": 4, "max_num_steps": 4, "val_period": 2, "seed": 3, "deterministic": True},
        "grpo": {"num_generations_per_prompt": 4},
        "logger": {"log_dir": str(run_dir), "print_table": False, "plot": False},  # curves.png: one test below
        "checkpointing": {"enabled": True, "checkpoint_dir": str(run_dir / "ckpt"), "save_period": 1, "keep_last_k": 3},
    }
    for key, value in extra.items():
        set_dotted(recipe, key, value)
    return recipe


_preloaded: PreloadedCli | None = None

# A resumed run repeats the uninterrupted one's records exactly, but for these: each is the gap between
# two float32 forwards of the same weights (the trainer's and the generator's), zero up to rounding,
# and the rounding follows how the generator batched the step's sequences. 1e-5 is about ten ulps of a
# logprob of magnitude 8-16 (one ulp: 9.5e-7).
ROUNDING_GAPS = {"train/gen_kl_error", "train/rollout_kl_k3", "refit/probe_max_abs_logprob_diff",
                 "refit/probe_mean_abs_logprob_diff"}


def assert_same_record(a: dict, b: dict, where) -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-5 if key in ROUNDING_GAPS else 1e-9), (where, key)


@pytest.fixture(scope="module", autouse=True)
def preloaded_runs():
    """The runs of a module that uses this fixture (this one, and those that import it) are processes
    forked from one that imported the libraries once: the imports would be most of a tiny run's
    time on two cores. Ray runs keep a fresh interpreter each."""
    global _preloaded
    _preloaded = PreloadedCli()
    yield
    _preloaded.close()
    _preloaded = None


def run_recipe(recipe: dict, tmp: Path, env: dict | None = None, timeout: int = 300,
               prelude: str = "") -> subprocess.CompletedProcess:
    """Run ``recipe`` in a fresh process; ``prelude`` (Python) runs first there, e.g. to inject a fault."""
    path = tmp / f"recipe-{os.urandom(3).hex()}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = textwrap.dedent(prelude) + textwrap.dedent(f"""
        import rlcore
        if __name__ == "__main__":
            rlcore.run(rlcore.load_config({str(path)!r}))
    """)
    if recipe.get("cluster", {}).get("use_ray"):  # Ray runs keep a fresh interpreter (preloaded_runs)
        return subprocess.run([sys.executable, "-c", code], env={**os.environ, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
    return run_script(code, tmp, env, timeout)


def run_rlcore(argv: list[str], tmp: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``rlcore *argv`` (the CLI) in a fresh process, without Ray."""
    env = {**os.environ, **(env or {})}
    if _preloaded is not None:
        return _preloaded.run_cli(argv, env, tmp, timeout)
    return subprocess.run([sys.executable, "-m", "rlcore.cli", *argv], env=env, capture_output=True, text=True, timeout=timeout)


def run_script(code: str, tmp: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh process, without Ray."""
    env = {**os.environ, **(env or {})}
    if _preloaded is not None:
        return _preloaded.run_script(code, env, tmp, timeout)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def load_records(run_dir: Path) -> dict[int, dict]:
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES)}
    return records


@pytest.fixture(scope="module")
def straight_run(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny recipe's four steps, uninterrupted: the reference the variants below must equal."""
    tmp = tmp_path_factory.mktemp("straight")
    done = run_recipe(tiny_recipe(tiny_model_dir, tmp / "straight", **{"logger.plot": True}), tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "straight"


def test_a_run_plots_its_curves_when_asked(straight_run):
    """``logger.plot`` (the straight run) writes curves.png; the other runs here set it false
    (about 1 s a run), and the resumed run below checks that then none is written."""
    png = (straight_run / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_resume_after_kill_matches_uninterrupted(tiny_model_dir, straight_run, tmp_path):
    killed_dir = tmp_path / "killed"
    killed = run_recipe(tiny_recipe(tiny_model_dir, killed_dir), tmp_path, env=fault_env("crash:train:3"))
    assert killed.returncode != 0
    complete = sorted(p.name for p in (killed_dir / "ckpt").iterdir())
    assert complete == ["step_000001", "step_000002"], complete  # step 3 never finished, nothing half-written
    resumed = run_recipe(tiny_recipe(tiny_model_dir, killed_dir), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert not (killed_dir / "curves.png").exists()  # logger.plot false
    a, b = load_records(straight_run), load_records(killed_dir)
    lines = [json.loads(line) for line in (killed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4], "each step once, the resumed run's records after the killed run's"
    assert [r["data_position"] for r in lines] == [4, 8, 12, 16], "four prompts a step, none skipped, none twice"
    assert len({r["run_id"] for r in lines}) == 1 and lines[0]["run_id"], "a resumed run keeps its run id"
    straight_summary = json.loads((straight_run / "summary.json").read_text())
    resumed_summary = json.loads((killed_dir / "summary.json").read_text())
    assert resumed_summary["num_steps"] == straight_summary["num_steps"] == 3  # steps 2-4: the saved step 2 too
    for step in (3, 4):
        assert_same_record(a[step], b[step], step)
    assert "val/accuracy" in a[4]


def test_offloaded_trainer_state_changes_nothing(tiny_model_dir, straight_run, tmp_path):
    """``colocated.offload_trainer_state``: the optimizer state and gradients leave the trainer
    (on CPU the fsdp2 backend really copies each storage out and frees it) between training and
    the next step, and come back for each checkpoint; every step's numbers equal the plain run's."""
    run_dir = tmp_path / "offload"
    done = run_recipe(tiny_recipe(tiny_model_dir, run_dir, **{"policy.generation.colocated.offload_trainer_state": True}), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["timing/offload"] > 0 for r in lines)
    a, b = load_records(straight_run), load_records(run_dir)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert_same_record(a[step], b[step], step)
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir())[-1] == "step_000004"


# The injected faults: the rollout thread takes 1.5 s to reach the generator before each batch (as one
# that waits for the interpreter lock while the trainer's thread launches kernels), longer than a step;
# scoring the first batch off the trainer's thread takes 2.5 s. Each generation's start and end and each
# scoring's end go to the file RLCORE_TEST_EVENTS names.
SLOW_PRODUCER = """
    import json, os, threading, time
    from rlcore.controller import rollouts as _rollouts
    def _event(name, batch, at):
        with open(os.environ["RLCORE_TEST_EVENTS"], "a") as f:
            f.write(json.dumps([name, batch, at]) + "\\n")
    _rollout_group, _score = _rollouts.Rollouts._rollout_group, _rollouts.score
    def _late(self, step, round_, observer=None):
        if threading.current_thread().name == "rlcore-rollouts":
            time.sleep(1.5)
        generated = _rollout_group(self, step, round_, observer)
        _event("generated", step, [generated.began, time.perf_counter()])
        return generated
    _slowed = []
    def _slow_score(environment, trajectories):
        if threading.current_thread() is not threading.main_thread() and not _slowed:
            _slowed.append(time.sleep(2.5))
        out = _score(environment, trajectories)
        _event("scored", threading.current_thread().name, time.perf_counter())
        return out
    _rollouts.Rollouts._rollout_group, _rollouts.score = _late, _slow_score
"""


def test_async_mode_respects_max_trajectory_age(tiny_model_dir, tmp_path):
    """One step off exactly, even with a rollout thread slow to reach the generator: each refit but
    the last waits until the next batch's generation has begun, so every batch after the first
    comes from the weights one step old (without that wait these batches were all fresh). And a
    batch's scoring does not hold up the next generation: the second batch's generation begins while
    the first is being scored, yet no batch is sampled before the refit it must follow (a rollout
    thread back at the generator at once would otherwise sample batches two steps old)."""
    recipe = tiny_recipe(tiny_model_dir, tmp_path / "async", **{
        "grpo.async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}, "train.deterministic": False,
        "algorithm.gen_is_cap": 2.0, "checkpointing.enabled": False,
    })
    events_path = tmp_path / "events.jsonl"
    done = run_recipe(recipe, tmp_path, prelude=SLOW_PRODUCER, env={"RLCORE_TEST_EVENTS": str(events_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [r for r in load_records(tmp_path / "async").values() if "async/trajectory_age" in r]
    assert [r["async/trajectory_age"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    events = [json.loads(line) for line in events_path.read_text().splitlines()]
    generated = {batch: span for name, batch, span in events if name == "generated"}
    first_scored = min(at for name, thread, at in events if name == "scored" and thread == "rlcore-scoring")
    assert generated[1][1] < generated[2][0] < first_scored, events
    lines = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    later = [r for r in lines if r["step"] > 1]
    assert later and all(r["async/generator_idle_s"] >= 0 and r["async/batch_wait_s"] >= 0 for r in later)
    # the wait for the trainer and the way back to the generator lie inside the idle time (after the generation ended)
    assert all(0 <= r["async/generator_waits_for_trainer_s"] + r["async/generator_start_s"] <= r["async/generator_idle_s"] + 1e-6
               for r in later)
    # the wake-up after the trainer's release lies inside the wait for it
    assert all(0 <= r[f"async/generator_wake_after_{kind}_s"] <= r["async/generator_waits_for_trainer_s"] + 1e-6
               for r in later for kind in ("done", "credit"))
    # step k's refit takes the generator when batch k+1's generation ends and frees it for batch k+2's:
    # the wait for the lock and the hold lie inside batch k+2's idle time
    by_step = {r["step"]: r for r in lines}
    pairs = [(r, by_step[r["step"] + 2]) for r in lines if r["step"] + 2 in by_step]
    assert pairs and all(0 <= r["async/refit_after_generation_s"] and r["async/refit_after_generation_s"]
                         + r["refit/generator_hold_s"] <= later_r["async/generator_idle_s"] + 1e-6 for r, later_r in pairs), lines
    assert all(r["time/gc_s"] >= r["time/gc_longest_s"] >= 0 for r in lines)


@pytest.fixture(scope="module")
def ray_crash_run(tiny_model_dir, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """Trainer as a Ray actor, generator in the driver; the trainer's process dies in step 3's train.
    The two tests below read it: steps 1 and 2 (each refit across processes) and the crash after them."""
    tmp = tmp_path_factory.mktemp("ray-crash")
    run_dir = tmp / "crash"
    recipe = tiny_recipe(tiny_model_dir, run_dir, **{"cluster.use_ray": True, "cluster.timeout_s": 120})
    return run_recipe(recipe, tmp, env=fault_env("crash:train:3")), run_dir


def test_ray_trainer_crash_names_worker_and_keeps_checkpoint(ray_crash_run):
    done, run_dir = ray_crash_run
    assert done.returncode != 0
    assert "trainer rank 0" in done.stderr and "'train'" in done.stderr and "step 3" in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == ["step_000001", "step_000002"]


@pytest.mark.wall_clock
def test_ray_trainer_hang_times_out_with_report(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "hang"
    # The limit also bounds the generation and the trainer calls before the hung 'train' (generation
    # took over 2 s on two busy cores); the driver waits all of it for the hung rank.
    recipe = tiny_recipe(tiny_model_dir, run_dir, **{"cluster.use_ray": True, "cluster.timeout_s": 8,
                                                      "checkpointing.enabled": False, "train.max_num_steps": 2})
    done = run_recipe(recipe, tmp_path, env=fault_env("hang:train:1"))
    assert done.returncode != 0
    assert "timeout" in done.stderr and "trainer ranks [0]" in done.stderr and "'train'" in done.stderr, done.stderr[-3000:]


def test_non_colocated_trainer_process_refits_driver_generator(ray_crash_run):
    """Trainer in a Ray actor process, generator in the driver: weights cross processes each step
    (the steps before the crash)."""
    done, run_dir = ray_crash_run
    records = load_records(run_dir)
    for step in (1, 2):
        assert records[step]["refit/bytes"] > 0, done.stderr[-3000:]
        assert records[step]["refit/probe_max_abs_logprob_diff"] < 1e-4


def test_multi_turn_environment_runs_through_the_loop(tiny_model_dir, tmp_path):
    """math_tool: rewards come from the turn-by-turn rollout, not from re-scoring the last turn."""
    run_dir = tmp_path / "tool"
    recipe = tiny_recipe(tiny_model_dir, run_dir, **{
        "env": {"name": "math_tool", "math_tool": {"executor": "inline", "max_turns": 2}},
        "checkpointing.enabled": False, "train.max_num_steps": 2, "train.val_period": 0,
    })
    done = run_recipe(recipe, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = load_records(run_dir)
    assert records[2]["rollout/num_trajectories"] == 16
    assert "env/correct" in records[2] and "train/loss" in records[2]


HUNG_SESSIONS = """
    import itertools, threading
    from rlcore.interfaces import EnvStep
    from rlcore_math.envs import MathToolEnvironment

    opened = itertools.count()

    class Session:  # injected fault: every other session never answers
        def __init__(self):
            self.hangs = next(opened) % 2 == 0
        def step(self, turn):
            if self.hangs:
                threading.Event().wait()
            return EnvStep(reward=1.0, done=True, metrics={"correct": 1.0})
        def close(self):
            pass

    MathToolEnvironment.open_session = lambda self, sample: Session()
"""


def test_hung_environment_sessions_score_0_and_the_run_ends(tiny_model_dir, tmp_path):
    """A session environment whose sessions hang (env.on_timeout=zero), rolled out one step off on
    the async rollout thread: every step ends within cluster.timeout_s, the hung trajectories score 0
    and count in env/timeout, each timeout names the step whose batch it was rolling out (that thread
    works ahead of the trainer), and the process exits (no environment thread is left to join)."""
    run_dir = tmp_path / "hung"
    recipe = tiny_recipe(tiny_model_dir, run_dir, **{
        "env": {"name": "math_tool", "math_tool": {"executor": "inline", "max_turns": 2}, "on_timeout": "zero"},
        "cluster.timeout_s": 4, "checkpointing.enabled": False, "train.max_num_steps": 2, "train.val_period": 0,
        "grpo.async_grpo": {"enabled": True, "max_trajectory_age_steps": 1},
    })
    done = run_recipe(recipe, tmp_path, prelude=HUNG_SESSIONS, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    timeouts = [line for line in done.stdout.splitlines() if "environment 'math_tool' (session step) did not answer within" in line]
    named = {line.split(" at step ")[1].split(";")[0] for line in timeouts}
    assert timeouts and named <= {"1", "2"} and "1" in named, timeouts
    records = load_records(run_dir)
    for step in (1, 2):
        assert records[step]["env/timeout"] == 0.5 and records[step]["env/correct"] == 0.5
        assert records[step]["rollout/num_trajectories"] == 16


def test_rlcore_run_whose_process_would_not_exit_ends_with_the_runs_status(tiny_model_dir, tmp_path):
    """`rlcore run` with a thread that never returns (what kept a finished GPU run alive): once the
    summary is written, the process prints that thread's stack and exits 0 after cluster.exit_timeout_s."""
    run_dir = tmp_path / "stuck"
    recipe = tiny_recipe(tiny_model_dir, run_dir, **{"checkpointing.enabled": False, "train.max_num_steps": 1,
                                                      "train.val_period": 0})
    path = tmp_path / "stuck.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = textwrap.dedent(f"""
        import sys, threading
        def a_thread_that_never_returns():
            threading.Event().wait()
        threading.Thread(target=a_thread_that_never_returns).start()
        sys.argv = ["rlcore", "run", {str(path)!r}, "cluster.exit_timeout_s=2"]
        from rlcore.cli.commands import main
        sys.exit(main())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "did not exit within 2s (cluster.exit_timeout_s)" in done.stderr
    assert "a_thread_that_never_returns" in done.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
