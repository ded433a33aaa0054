"""One step off, killed and resumed again and again: the run must come out as if never stopped.

A deterministic async run (``max_trajectory_age_steps: 1``, hf generator, math env) is stopped at
ten or more points, each followed by a resume of the same command: four kills inside a chosen
phase through ``RLCORE_FAULT`` (the trainer's process exits mid-call: mid-training, mid-logprobs,
mid-refit, mid-checkpoint), and random moments (a seeded draw, printed) by SIGKILL or SIGTERM,
which land mid-generation and mid-scoring as often as anywhere. Then:

- one record per step, steps 1..N in order (the killed attempts' lines included);
- each step's record equals the uninterrupted run's (rewards, losses, logprobs, accuracies: the
  same prompts in the same batches, sampled with the same seeds), so every prompt the straight
  run trained on was trained exactly once and no batch twice;
- every trained batch within the staleness bound (``async/trajectory_age`` <= 1).

Each attempt is bounded (``ATTEMPT_S``), so a resume that hangs fails the test in bounded time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_loop import TIMING_PREFIXES, tiny_recipe

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xfail(run=False, reason="async resume loses in-flight prompts and spins from step 3 on "
                                        "(being rewritten with the async driver); run it with --runxfail"),
]

STEPS = 8
ATTEMPT_S = 150
PHASE_KILLS = ["crash:train:2", "crash:logprobs:3", "crash:export_weights:4", "crash:save_checkpoint:5"]
RANDOM_KILLS = 7
ASYNC_ONLY_KEYS = ("async/", "rollout/refill_rounds")


def _recipe(model_dir: Path, run_dir: Path) -> dict:
    return tiny_recipe(model_dir, run_dir, **{
        "grpo.async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}, "grpo.max_num_steps": STEPS,
        "grpo.val_period": 0, "cluster.timeout_s": 60})


def _start(recipe_path: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlcore.cli", "run", str(recipe_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES + ASYNC_ONLY_KEYS)}


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=ATTEMPT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"an attempt did not end within {ATTEMPT_S}s:\n{out[-3000:]}")
    return out


def _kill_at_random(proc: subprocess.Popen, rng: random.Random, sig: int, startup_s: float, step_s: float) -> str:
    """Send ``sig`` a random moment into the loop: past the process's start-up (imports, model,
    engine), within about one and a half steps, so that it lands in any phase of a step."""
    time.sleep(0.7 * startup_s + rng.uniform(0.0, 1.5 * step_s))
    if proc.poll() is None:
        proc.send_signal(sig)
    return _finish(proc)


def test_one_step_off_survives_kills_at_every_phase(tiny_model_dir, tmp_path):
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "killed"
    for directory in (straight_dir, run_dir):
        path = tmp_path / f"{directory.name}.yaml"
        path.write_text(yaml.safe_dump(_recipe(tiny_model_dir, directory)))
    began = time.monotonic()
    out = _finish(_start(tmp_path / "straight.yaml"))
    straight = _records(straight_dir)
    assert [r["step"] for r in straight] == list(range(1, STEPS + 1)), out[-3000:]
    loop_s = straight[-1]["time/elapsed_s"]
    startup_s, step_s = max(time.monotonic() - began - loop_s, 1.0), loop_s / STEPS

    seed = int(os.environ.get("RLCORE_KILL_SEED", random.SystemRandom().randrange(1 << 30)))
    print(f"kill points drawn with RLCORE_KILL_SEED={seed}")
    rng = random.Random(seed)
    plan = [("fault", fault) for fault in PHASE_KILLS]  # in step order, each in a step still ahead
    plan += [("signal", rng.choice([signal.SIGKILL, signal.SIGTERM])) for _ in range(RANDOM_KILLS)]
    stops = 0
    for kind, what in plan:
        if len(_records(run_dir)) >= STEPS - 1:
            break  # the last step is left for the final resume
        if kind == "fault":
            step = int(what.rsplit(":", 1)[1])
            if step <= len(_records(run_dir)):
                continue  # that phase of that step is behind this run already
            _finish(_start(tmp_path / "killed.yaml", env={"RLCORE_FAULT": what}))
        else:
            _kill_at_random(_start(tmp_path / "killed.yaml"), rng, what, startup_s, step_s)
        stops += 1
        records = _records(run_dir)
        assert [r["step"] for r in records] == list(range(1, len(records) + 1)), (what, records)
    out = _finish(_start(tmp_path / "killed.yaml"))
    assert stops >= 10, f"only {stops} stops landed before the run ended (seed {seed})"

    resumed = _records(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1)), "one record per step, each step once"
    assert all(r["async/trajectory_age"] <= 1 for r in resumed), [r.get("async/trajectory_age") for r in resumed]
    for got, want in zip(resumed, straight):
        a, b = _comparable(got), _comparable(want)
        assert a.keys() == b.keys(), (got["step"], sorted(a.keys() ^ b.keys()))
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (got["step"], key, "seed", seed)
