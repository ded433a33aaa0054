"""One step off, killed and resumed again and again: no prompt skipped or trained twice, no step lost.

A deterministic async run (``max_trajectory_age_steps: 1``, hf generator, math env, one epoch of
16 steps, a checkpoint each step) is stopped at ten points, each followed by a resume of the
same command: four kills inside a chosen phase through the test-only fault plugin (:mod:`rlcore.testing.faults`) (the trainer's process
exits mid-call: mid-training, mid-logprobs, mid-refit, mid-checkpoint), and six by SIGKILL or
SIGTERM at a random moment (a seeded draw, printed) within about a step after the attempt's
resume, which lands mid-generation, mid-scoring, mid-training or mid-refit as the draw falls. Then:

- one record per step, steps 1..N in order (the killed attempts' lines included), of one run id;
- each step's ``data_position`` (prompts drawn up to its batch, in the cursor's seeded order) is
  four more than the step before's, and the last checkpoint stands at the epoch's end (64 of 64):
  every prompt of the epoch trained exactly once, no batch twice, none skipped;
- every trained batch within the staleness bound (``async/trajectory_age`` <= 1), none dropped.

The records are not compared with an uninterrupted run's: a resumed run samples the batch that was
in flight again, with the weights of the checkpoint, one policy version newer than the batch it
replaces (its age is 0 where the uninterrupted run's was 1), so the numbers part from there on.

Each attempt is bounded (``ATTEMPT_S``), so a resume that hangs fails the test in bounded time.
Each is a process of its own that runs the CLI's ``rlcore run``, forked from a server that has
imported the libraries once (``_preloaded_cli``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import yaml

from _preloaded_cli import PreloadedCli
from test_loop import tiny_recipe

from rlcore.controller.checkpoint import CheckpointManager
from rlcore.testing.faults import fault_env

pytestmark = pytest.mark.slow

STEPS, P, PROMPTS = 16, 4, 64  # one epoch of the tiny recipe's arithmetic data, four prompts a step
ATTEMPT_S = 150
PHASE_KILLS = ["crash:train:2", "crash:logprobs:3", "crash:export_weights:4", "crash:save_checkpoint:5"]
RANDOM_KILLS = 6


def _recipe(model_dir: Path, run_dir: Path) -> dict:
    return tiny_recipe(model_dir, run_dir, **{
        "grpo.async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}, "train.max_num_steps": STEPS,
        "train.val_period": 0, "cluster.timeout_s": 60})


@pytest.fixture(scope="module")
def cli():
    """Each attempt is a fresh process forked from one that imported the libraries once: eleven
    interpreters' imports would be most of this test's time on two cores."""
    server = PreloadedCli()
    yield server
    server.close()


class Attempt:
    """One ``rlcore run`` of the recipe: its process and the file its stdout and stderr go to."""

    def __init__(self, cli: PreloadedCli, recipe_path: Path, env: dict | None = None):
        self.output = recipe_path.with_name(f"attempt-{os.urandom(3).hex()}.log")
        self.output.touch()
        self.proc = cli.start(["run", str(recipe_path)], {**os.environ, **(env or {})}, self.output)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def wait(self) -> str:
        self.proc.join(ATTEMPT_S)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
            pytest.fail(f"an attempt did not end within {ATTEMPT_S}s:\n{self.text()[-3000:]}")
        return self.text()


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _kill_at_random(attempt: Attempt, rng: random.Random, sig: int, step_s: float) -> str:
    """Send ``sig`` a random moment within about a step after the attempt's resume (its "resumed
    from" line: start-up and resume are behind it), so that it falls in any phase of a step."""
    deadline = time.monotonic() + ATTEMPT_S
    while attempt.proc.exitcode is None and time.monotonic() < deadline:
        if any(line.startswith("resumed from") for line in attempt.text().splitlines()):
            time.sleep(rng.uniform(0.0, step_s))
            if attempt.proc.exitcode is None:
                os.kill(attempt.proc.pid, sig)
            break
        time.sleep(0.05)
    return attempt.wait()


def _data_position(run_dir: Path) -> int:
    manager = CheckpointManager(run_dir / "ckpt", keep_last_k=3)
    return manager.load_loop_state(manager.complete()[-1][1])["data_position"]


def test_one_step_off_survives_kills_at_every_phase(cli, tiny_model_dir, tmp_path):
    run_dir, recipe = tmp_path / "run", tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tiny_model_dir, run_dir)))
    seed = int(os.environ.get("RLCORE_KILL_SEED", random.SystemRandom().randrange(1 << 30)))
    print(f"kill points drawn with RLCORE_KILL_SEED={seed}")
    rng = random.Random(seed)
    plan = [("fault", fault) for fault in PHASE_KILLS]  # in step order, each in a step still ahead
    plan += [("signal", rng.choice([signal.SIGKILL, signal.SIGTERM])) for _ in range(RANDOM_KILLS)]
    stops = 0
    for kind, what in plan:
        records = _records(run_dir)
        if len(records) >= STEPS - 1:
            break  # the last step is left for the final resume (a SIGTERM ends a run after its step)
        if kind == "fault":
            step = int(what.rsplit(":", 1)[1])
            if step <= len(records):
                continue  # that phase of that step is behind this run already
            Attempt(cli, recipe, env=fault_env(what)).wait()
        else:  # a step's wall time, from the records so far (the phase kills left four)
            step_s = (records[-1]["time/elapsed_s"] - records[0]["time/elapsed_s"]) / max(len(records) - 1, 1)
            _kill_at_random(Attempt(cli, recipe), rng, what, step_s)
        stops += 1
        records = _records(run_dir)
        print(f"stop {stops} ({what}): {len(records)} records")
        assert [r["step"] for r in records] == list(range(1, len(records) + 1)), (what, records)
    out = Attempt(cli, recipe).wait()
    assert stops >= 10, f"only {stops} stops landed before the run ended (seed {seed})"

    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), ("one record per step, each step once", out[-3000:])
    # Each step's batch is the prompts from the step before's position to its own, in the cursor's
    # seeded order: four a step, none skipped, none twice, the last at the epoch's end.
    assert [r["data_position"] for r in records] == [P * step for step in range(1, STEPS + 1)], seed
    assert _data_position(run_dir) == PROMPTS, "the last checkpoint stands at the epoch's end"
    assert all(r["async/trajectory_age"] <= 1 for r in records), [r["async/trajectory_age"] for r in records]
    assert all(r["async/dropped_stale_batches"] == 0 for r in records), [r["async/dropped_stale_batches"] for r in records]
    assert len({r["run_id"] for r in records}) == 1
