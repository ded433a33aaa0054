"""Every algorithm through the same safety tests: the run skeleton (``rlcore.controller.run_skeleton``)
that the GRPO-family loop (grpo, ppo, distillation) and the offline loop (sft, dpo, reward_model)
plug their step into keeps each property once, for all of them.

- a stop signal after step 1 ends the run with a checkpoint of that step, and the same run started
  again resumes there and ends at the same last step, each step's record once;
- a stop signal within a validation step skips its held-out pass (the step's refit was skipped: the
  generator has the older weights and sleeps), saying so;
- a logger whose ``log`` never returns stops the run at ``cluster.timeout_s``, naming the logger;
- a streak of non-finite losses (``train.max_consecutive_nonfinite``) stops the run, saying so;
- a packing budget below one sequence, or more examples per step than the data holds, is refused
  before the policy's model loads, naming the key.

Real parts on CPU, in this process: a tiny random-init Llama, the fsdp2 backend (the reward model:
its own trainer), the hf generator and the math environment for the rollout loops. The faults are
injected on purpose: a logger passed to ``rlcore.run`` that sends the stop signal or hangs, and the
registered algorithm's loss made NaN for one test, the signal sent as a step's training begins.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest

import rlcore
from rlcore.config import ConfigError
from rlcore.deadlines import CallTimeout
from rlcore.controller.nonfinite import NonFiniteLossError
from rlcore.plugins import get_plugin_manager
from test_loop import tiny_recipe
from test_offline_loops import pair_recipe, sft_recipe

pytestmark = pytest.mark.slow

ROLLOUT_LOOP = ("grpo", "ppo", "distillation")
ALGORITHMS = (*ROLLOUT_LOOP, "sft", "dpo", "reward_model")
STEPS = 3


def recipe(name: str, model_dir: Path, run_dir: Path) -> dict:
    """``name``'s tiny CPU recipe, three steps, no validation, checkpoints only when a stop asks."""
    if name in ROLLOUT_LOOP:
        out = tiny_recipe(model_dir, run_dir)
        if name == "ppo":  # the critic trains beside the policy from the first step
            out["algorithm"] = {"name": "ppo", "critic_warmup_steps": 0}
        elif name == "distillation":  # the tiny model teaches a copy of itself
            out["algorithm"] = {"name": "distillation", "teacher_model": str(model_dir), "teacher_dtype": "float32",
                                "use_old_logprobs": False}
    elif name == "sft":
        out = sft_recipe(model_dir, run_dir)
    else:
        out = pair_recipe("dpo_tiny_cpu.yaml" if name == "dpo" else "rm_tiny_cpu.yaml", model_dir, run_dir)
    out["train"].update(max_num_steps=STEPS, val_period=0, val_at_start=False)
    out["checkpointing"] = {"enabled": True, "save_period": 1000, "keep_last_k": 1}  # under logger.log_dir
    out["logger"] = {"log_dir": str(run_dir), "print_table": False, "plot": False}
    return out


class Recorder:
    """A logger keeping what it is given; with ``stop_after``, it sends this process SIGTERM as that
    step's record arrives (a scheduler's preemption, at a step the test knows)."""

    def __init__(self, stop_after: int | None = None):
        self.steps: list[int] = []
        self.stop_after = stop_after

    def log(self, metrics: dict, step: int) -> None:
        self.steps.append(step)
        if step == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        pass


class Hangs:
    def log(self, metrics: dict, step: int) -> None:
        import time

        time.sleep(600)

    def close(self) -> None:
        pass


def poison_the_loss(name: str, config, monkeypatch) -> None:
    """The fault: the registered algorithm's loss is NaN from now on, its checks and gradients left as
    they are; the backend skips each update, as it does when a run diverges."""
    algorithm_cls = type(get_plugin_manager().get("algorithm", name).build(config.section("algorithm")))
    method = "pair_loss" if name == "reward_model" else "loss"
    finite = getattr(algorithm_cls, method)

    def poisoned(self, *args, **kwargs):
        loss, metrics = finite(self, *args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(algorithm_cls, method, poisoned)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_stop_signal_checkpoints_the_step_and_the_run_resumes_to_the_same_end(name, tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = rlcore.build_config(recipe(name, tiny_model_dir, run_dir))
    stopped = rlcore.run(config, loggers=[Recorder(stop_after=1)])
    assert stopped["summary"]["stopped_by_signal"] == "SIGTERM"
    assert [r["step"] for r in stopped["records"]] == [1]
    assert "SIGTERM received: stopped after step 1, checkpoint of step 1" in capsys.readouterr().out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]  # save_period is 1000

    again = Recorder()
    resumed = rlcore.run(config, loggers=[again])
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000001'} at step 1" in capsys.readouterr().out
    assert [r["step"] for r in resumed["records"]] == list(range(1, STEPS + 1)), "each step once"
    assert again.steps == list(range(2, STEPS + 1)) and resumed["summary"]["steps"] == STEPS
    assert [r["data_position"] for r in resumed["records"]] == sorted({r["data_position"] for r in resumed["records"]})


def signal_as_training_begins(monkeypatch) -> None:
    """SIGTERM to this process as the first step's training phase begins (the step timer's), a real signal:
    its handler runs in the main thread before the next line of the phase."""
    from rlcore.controller import timing

    original, sent = timing.StepTimer.phase, []

    @contextlib.contextmanager
    def phase(self, name: str):
        with original(self, name):
            if name == "training" and not sent:
                sent.append(name)
                os.kill(os.getpid(), signal.SIGTERM)
            yield

    monkeypatch.setattr(timing.StepTimer, "phase", phase)


@pytest.mark.parametrize("name", ["grpo", "grpo-async"])
def test_a_stop_signal_in_a_validation_step_skips_its_held_out_pass_and_says_so(name, tiny_model_dir, tmp_path, capsys,
                                                                               monkeypatch):
    """The signal skipped the step's refit: the generator holds the older weights (a colocated vLLM engine sleeps).
    An offline loop's validation reads the trainer and still runs (tests/test_offline_loops.py: its resumed records
    equal the uninterrupted run's, the stopped step's held-out loss included)."""
    run = recipe(name.removesuffix("-async"), tiny_model_dir, tmp_path / "run")
    run["train"].update(val_period=1, val_at_start=False)
    if name.endswith("-async"):
        run["grpo"]["async_grpo"] = {"enabled": True, "max_trajectory_age_steps": 1}
        run["train"]["deterministic"] = False
    signal_as_training_begins(monkeypatch)
    stopped = rlcore.run(rlcore.build_config(run))
    out = capsys.readouterr().out
    assert stopped["summary"]["stopped_by_signal"] == "SIGTERM"
    assert [r["step"] for r in stopped["records"]] == [1]
    assert not [k for k in stopped["records"][0] if k.startswith("val/")], stopped["records"][0]
    assert "SIGTERM received: the held-out validation of step 1 is skipped" in out
    assert "SIGTERM received: stopped after step 1, checkpoint of step 1" in out


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_logger_that_hangs_stops_the_run_naming_it(name, tiny_model_dir, tmp_path):
    run = recipe(name, tiny_model_dir, tmp_path / "run")
    run["cluster"] = {"timeout_s": 3}
    with pytest.raises(CallTimeout, match=r"logger Hangs \(log\) did not return within 3s \(cluster.timeout_s\) at step 1"):
        rlcore.run(rlcore.build_config(run), loggers=[Hangs()])


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_streak_of_non_finite_losses_stops_the_run(name, tiny_model_dir, tmp_path, monkeypatch):
    run = recipe(name, tiny_model_dir, tmp_path / "run")
    run["train"]["max_consecutive_nonfinite"] = 1
    config = rlcore.build_config(run)
    poison_the_loss(name, config, monkeypatch)
    seen = Recorder()
    with pytest.warns(UserWarning, match="step 1: non-finite loss"), pytest.raises(
            NonFiniteLossError, match=r"1 non-finite losses in a row \(train.max_consecutive_nonfinite\)"):
        rlcore.run(config, loggers=[seen])
    assert seen.steps == []  # stopped within step 1, before its record


@pytest.fixture(scope="module")
def unloadable_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with its weights cut short: a run that got as far as loading it fails there,
    so a run refused with a ConfigError was refused before."""
    model = tmp_path_factory.mktemp("unloadable") / "model"
    shutil.copytree(tiny_model_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:100])
    return model


BAD = {"policy.sequence_packing.train_mb_tokens": ("sequence_packing", {"enabled": True, "train_mb_tokens": 1}),
       "train.num_prompts_per_step": ("num_prompts_per_step", 100_000)}


@pytest.mark.parametrize("key", sorted(BAD))
@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_bad_size_is_refused_before_the_model_loads_naming_the_key(name, key, unloadable_model, tiny_model_dir, tmp_path):
    run = recipe(name, unloadable_model, tmp_path / "run")
    if name == "distillation":
        run["algorithm"]["teacher_model"] = str(tiny_model_dir)  # the teacher is not the model in question
    field, value = BAD[key]
    (run["policy"] if field == "sequence_packing" else run["train"])[field] = value
    with pytest.raises(ConfigError) as refused:
        rlcore.run(rlcore.build_config(run))
    assert refused.value.key == key, str(refused.value)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
