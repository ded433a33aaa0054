"""What a new user meets following the README, as subprocesses of the installed ``rlcore``.

One 3-step ``rlcore run`` of the tiny recipe (its vLLM generator, a plain reward function from
``env.reward_fn``, checkpoints every 2 steps, TensorBoard on) is shared by the tests below: its
console, its final model and last-step checkpoint, then ``rlcore export`` and ``rlcore eval`` on
its run directory. SIGTERM at each phase of a step is a chain of runs that each resume the one
before; the chain's last run, resumed once more, ends by Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo_arith_tiny_cpu.yaml"
REWARDS = '''
def exact_sum(prompts, completions, **kwargs):
    """TRL's reward-function signature: one float per completion; the dataset's answers come as a column."""
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, kwargs["answer"])]
'''
# Lines of a third party: log records (vLLM's "INFO 12-04 ...", Python's "WARNING:..."), progress bars, warnings.
THIRD_PARTY = re.compile(r"^(\(\w+ pid=\d+\) |\[rank\d+\]:)|^(INFO|WARNING|DEBUG|ERROR)[ :]|it/s\]|s/it\]|Warning:|warn\(")


def rlcore(*args, env=None, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "rlcore"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RLCORE_", "VLLM_LOGGING", "TRANSFORMERS_VERB"))},
           "COLUMNS": "80", **(env or {})}
    return subprocess.run([str(script), *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


def overrides(model_dir: Path, run_dir: Path, generator: str = "hf", **extra) -> list[str]:
    settings = {"policy.model_name": model_dir, "policy.generation.backend": generator, "policy.max_total_sequence_length": 48,
                "train.max_num_steps": 3, "train.num_prompts_per_step": 4, "grpo.num_generations_per_prompt": 4,
                "train.val_period": 3, "train.max_val_samples": 8, "data.num_validation": 8, "logger.log_dir": run_dir,
                "logger.plot": "false", **extra}
    return [f"{k}={v}" for k, v in settings.items()]


@pytest.fixture(scope="module")
def rewards_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("rewards")
    (site / "my_rewards.py").write_text(REWARDS)
    return site


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, rewards_site, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("first-hour") / "run"
    # the recipe's own generator, vLLM: the libraries' lines counted below are mostly its. Compiled (Inductor on CPU),
    # as on a GPU by default, where on CPU the default skips it for a faster start: a compiled engine's refits run here.
    done = rlcore("run", RECIPE, *overrides(tiny_model_dir, run_dir, generator="vllm", **{
        "env.reward_fn": "my_rewards:exact_sum", "checkpointing.enabled": "true", "checkpointing.save_period": 2,
        "logger.tensorboard.enabled": "true", "policy.generation.enforce_eager": "false"}), env={"PYTHONPATH": os.pathsep.join(filter(None, [str(rewards_site), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return run_dir, done


def test_a_run_prints_its_own_lines_and_few_of_the_libraries(tiny_run):
    """At the default verbosity the libraries' INFO logs and progress bars are off: no more than 15
    lines that rlcore did not print, and nothing on stderr."""
    _, done = tiny_run
    lines = (done.stdout + done.stderr).splitlines()
    noise = [line for line in done.stderr.splitlines() if line.strip()] + [l for l in done.stdout.splitlines() if THIRD_PARTY.search(l)]
    assert len(noise) <= 15, noise
    assert "Loading weights" not in done.stderr, done.stderr[-2000:]
    assert sum(1 for line in lines if line.strip()) > 10  # the step table, the summary, the outputs


def test_every_run_writes_its_final_model_and_a_last_step_checkpoint(tiny_run):
    run_dir, done = tiny_run
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(run_dir / "model").config.num_hidden_layers > 0
    assert AutoTokenizer.from_pretrained(run_dir / "model").eos_token_id is not None
    # save_period 2 of 3 steps: step 2 by the period, step 3 because it is the last
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    # where the outputs went: model, checkpoint, metrics, TensorBoard's event files
    tail = done.stdout[done.stdout.index("outputs of this run"):]
    for what, path in (("model", run_dir / "model"), ("checkpoint", run_dir / "checkpoints" / "step_000003"),
                       ("TensorBoard", run_dir / "tensorboard"), ("metrics", run_dir / "metrics.jsonl"),
                       ("rollout traces", run_dir / "rollouts.jsonl")):
        assert re.search(rf"{what}.*{re.escape(str(path))}", tail), (what, tail)


def test_rlcore_rollouts_prints_the_runs_traces(tiny_run):
    """The run's traces (vLLM's rollouts, 16 a step: 8 traced), worst first, and TensorBoard's table of them."""
    run_dir, _ = tiny_run
    traces = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [t["step"] for t in traces] == [1] * 8 + [2] * 8 + [3] * 8
    assert all(len(t["sampling_logprobs"]) == len(t["response_ids"]) == len(t["loss_mask"]) > 0 for t in traces)
    done = rlcore("rollouts", run_dir, "--worst", "-n", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    shown = [float(r) for r in re.findall(r"step 3 · sample \d+ · reward (\S+)", done.stdout)]
    assert len(shown) == 3 and shown == sorted(shown) and "3 trajectories of step 3" in done.stdout
    assert any(t["completion"] and t["completion"] in done.stdout for t in traces if t["step"] == 3)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("rollouts/text_summary")] == [1, 2, 3]


def test_the_summary_says_what_it_shows(tiny_run):
    run_dir, done = tiny_run
    assert "grpo summary: mean seconds per step" in done.stdout
    assert "Scoring" in done.stdout and "Reward " not in done.stdout
    assert re.search(r"held-out accuracy \d\.\d{3} -> \d\.\d{3} \([+-]\d\.\d{3}\)", done.stdout), done.stdout[-1500:]
    assert "probe mean/max:" in done.stdout  # the per-step table's legend
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env/reward_fn_errors"] == 0.0 for r in records if "env/reward_fn_errors" in r)
    assert any("env/reward_fn_errors" in r for r in records), "the plain reward function scored the rollouts"


def test_export_and_eval_work_on_the_run_directory(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    exported = rlcore("export", run_dir, tmp_path / "hf", "--json")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert json.loads(exported.stdout)["checkpoint"].endswith("step_000003")  # stdout: the JSON and nothing else
    evaluated = rlcore("eval", run_dir, RECIPE, *overrides(run_dir / "model", tmp_path / "unused"), "--no-progress")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    summary = json.loads(evaluated.stdout)  # `rlcore eval ... > eval.json` is valid JSON
    assert summary["num_prompts"] == 8 and 0.0 <= summary["greedy_accuracy"] <= 1.0
    assert "Loading weights" not in evaluated.stderr  # transformers' progress bar: off unless --verbose


def start_in_own_group(model_dir: Path, run_dir: Path, launcher: list[str] | None = None, flags: tuple[str, ...] = (),
                       **extra) -> subprocess.Popen:
    """``rlcore run`` of the recipe with its vLLM generator for up to 500 steps, checkpointing, in a process
    group of its own (as a terminal's job, or a scheduler's). ``launcher``: the command that stands for
    the ``rlcore`` script (it takes the same arguments after it); ``flags``: options after the overrides."""
    script = Path(sys.executable).parent / "rlcore"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RLCORE_", "VLLM_LOGGING", "VLLM_ENABLE_V1_MULTI"))},
           "COLUMNS": "200"}
    argv = [*(launcher or [str(script)]), "run", str(RECIPE), *group_run_args(model_dir, run_dir, **extra), *flags]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def group_run_args(model_dir: Path, run_dir: Path, **extra) -> list[str]:
    # the default's eager engine on CPU: these runs test signals, not vLLM's compiled model (tiny_run's)
    return overrides(model_dir, run_dir, generator="vllm", **{
        "train.max_num_steps": 500, "train.val_period": 0, "checkpointing.enabled": "true", **extra})


def recorded_steps(run_dir: Path) -> list[int]:
    """The steps of the run's whole metrics records so far (a line still being written is left out)."""
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().split("\n")[:-1] if metrics.exists() else []
    return [json.loads(line)["step"] for line in lines]


def children_once_a_step_is_recorded(proc: subprocess.Popen, run_dir: Path, psutil, after: int) -> list:
    """Waits for the run's first metrics record of a step past ``after``; its processes then (the engine's among them)."""
    deadline = time.monotonic() + 480
    while not any(step > after for step in recorded_steps(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return psutil.Process(proc.pid).children(recursive=True)


def ctrl_c_the_group(model_dir: Path, run_dir: Path, settings: dict, resumed_at: int, psutil) -> int:
    """A terminal's Ctrl-C: SIGINT to the whole foreground process group, here ``rlcore run --resume`` (from
    step ``resumed_at``, checkpointing only when it stops) and the processes of the recipe's vLLM
    engine, once the run has recorded a step. The engine takes no part in it: the step ends, its
    checkpoint is written, one line says how to resume, and the engine's processes end with the run.
    Returns the step the run stopped after."""
    settings = {**settings, "checkpointing.save_period": 1000}  # the checkpoint below is the stop's own
    proc = start_in_own_group(model_dir, run_dir, flags=("--resume",), **settings)
    try:
        children = children_once_a_step_is_recorded(proc, run_dir, psutil, after=resumed_at)
        assert any(p.name().startswith("VLLM::") for p in children), [p.name() for p in children]  # the engine's own
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGINT, out[-2000:] + err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert re.search(rf"resumed from \S+ at step {resumed_at}\b", out), out[-2000:]
    match = re.search(r"SIGINT received: stopped after step (\d+), checkpoint of step \1 in (\S+); the same command resumes", out)
    assert match, out[-2000:]
    step = int(match.group(1))
    assert resumed_at < step < 500 and (run_dir / "checkpoints" / f"step_{step:06d}" / "loop_state.pt").is_file()
    assert "Ctrl-C: stopping after step" in out
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]
    return step


PHASE_LAUNCHER = Path(__file__).with_name("_phase_signal.py")
GROUP_TIMEOUT_S = 30  # cluster.timeout_s of the runs below
# What the process may take past cluster.timeout_s: the deadline's own exit writes every thread's
# stack first, and the interpreter's exit runs after the run has ended; on a loaded 2-core machine
# a few seconds each.
EXIT_MARGIN_S = 10


def pids_of_group(pgid: int, psutil) -> list[tuple[int, str]]:
    """The processes left in process group ``pgid`` (none once the run and all it started have ended)."""
    left = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(p.pid) == pgid:
                left.append((p.pid, p.info["name"]))
        except (ProcessLookupError, psutil.Error):
            pass
    return left


# (phase, step of its run) where each run of the chain below is signalled: every run but the first is the
# same command again, which resumes the one before. Step 2 of its run: one whole step of that process is
# behind it.
PHASES = (("generation", 2), ("training", 2), ("refit", 2), ("checkpoint", 2))


def checkpoint_kept(phase: str, resumed_at: int, step_of_run: int) -> int:
    """The newest checkpoint once a run resumed at ``resumed_at`` is signalled in ``phase`` of its
    ``step_of_run``-th step (save_period 1): that step's once its training has begun, else the step before."""
    return resumed_at + step_of_run - (phase == "generation")


def signal_the_group_in(phase: str, step_of_run: int, model_dir: Path, run_dir: Path, marker: Path, settings: dict,
                        psutil) -> tuple[str, str, float, list]:
    """Starts the run (resuming when it has a checkpoint) held in ``phase`` of its ``step_of_run``-th step,
    SIGTERMs its whole process group there and waits for it to end: (stdout, stderr, seconds from the
    signal to its end, the processes it had when signalled)."""
    marker.unlink(missing_ok=True)
    launcher = [sys.executable, str(PHASE_LAUNCHER), phase, str(step_of_run), str(marker), "--"]
    proc = start_in_own_group(model_dir, run_dir, launcher, **settings)
    try:
        deadline = time.monotonic() + 600  # an engine start on a loaded 2-core machine: up to 8 minutes seen
        while not marker.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                pytest.fail(f"the run did not reach {phase} of its step {step_of_run} (status {proc.returncode}): "
                            f"{out[-1500:]} {err[-3000:]}")
            time.sleep(0.05)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any(p.name().startswith("VLLM::") for p in children), (phase, [p.name() for p in children])
        os.killpg(proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=240)
        ended_after = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, (phase, out[-2000:] + err[-3000:])
    assert pids_of_group(proc.pid, psutil) == [], phase
    return out, err, ended_after, children


# Not a wall_clock test: its one bound (the run ends within cluster.timeout_s + EXIT_MARGIN_S of the signal) holds
# beside the suite's other worker; 7.6-10.5 s from the signal to the end with another test running on the two cores.
@pytest.mark.timeout(3600)  # five engine starts (a run and four resumes) of up to 8 minutes each on a loaded machine
def test_a_process_group_sigterm_at_each_phase_then_ctrl_c_end_the_run_resumably(tiny_model_dir, tmp_path):
    """SIGTERM to the whole process group (``timeout``, Slurm, Kubernetes) of a vLLM run while it is in
    each phase of a step (the step timer's: the launcher holds there until the signal has arrived),
    one phase a run: a run, then the same command again each time (it resumes). vLLM's engine dies with it.
    The run ends within cluster.timeout_s of the signal, exit 143, with the checkpoint of that step
    once its training has begun (the refit its weights were for is skipped: no step follows), else
    of the step before; nothing of its process group is left; the next run goes on from that
    checkpoint. A last run resumes once more and ends by Ctrl-C (:func:`ctrl_c_the_group`), with each
    step's record once."""
    psutil = pytest.importorskip("psutil")
    run_dir, marker = tmp_path / "run", tmp_path / "in-phase"
    settings = {"checkpointing.save_period": 1, "cluster.timeout_s": GROUP_TIMEOUT_S, "train.val_at_start": "false"}
    kept = 0  # the checkpoint each run resumes from (none for the first)
    for phase, step_of_run in PHASES:
        out, err, ended_after, children = signal_the_group_in(phase, step_of_run, tiny_model_dir, run_dir, marker,
                                                             settings, psutil)
        assert kept == 0 or re.search(rf"resumed from \S+ at step {kept}\b", out), (phase, out[-2000:])
        assert ended_after < GROUP_TIMEOUT_S + EXIT_MARGIN_S, (phase, ended_after, out[-2000:], err[-3000:])
        # the engine logs its own end
        ours = [line for line in err.splitlines() if not line.startswith(("(EngineCore", "(Worker"))]
        assert not any("Traceback" in line for line in ours), (phase, err[-3000:])
        assert re.search(r"SIGTERM received(: stopped after step \d+|: the run stopped mid-step| .*has not ended)",
                         out + err), (phase, err[-3000:])
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, (phase, [(p.pid, p.name()) for p in alive])
        kept = checkpoint_kept(phase, kept, step_of_run)
        steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        print(phase, steps, f"{ended_after:.1f}s", out[-1500:], "\n".join(ours)[-3000:], sep="\n")
        newest = run_dir / "checkpoints" / steps[-1]
        assert steps[-1] == f"step_{kept:06d}" and (newest / "loop_state.pt").is_file(), (phase, steps)
        assert recorded_steps(run_dir) == list(range(1, kept + 1)), (phase, recorded_steps(run_dir))
    last_step = ctrl_c_the_group(tiny_model_dir, run_dir, settings, kept, psutil)
    assert recorded_steps(run_dir) == list(range(1, last_step + 1)), recorded_steps(run_dir)
