"""The offline loops (SFT on reference answers; DPO and reward models on preference pairs)
through ``rlcore run`` on CPU with real parts: a tiny random-init Llama, the fsdp2 backend (SFT,
DPO) or the reward model's own trainer, the arithmetic and preference datasets. SFT lowers the
held-out loss; a run ended by SIGTERM checkpoints its step, exits 143, and resumed with the same
``logger.log_dir`` gives the uninterrupted run's records; a malformed data row ends ``rlcore run``
with one message naming the file and row, exit status 2.

The runs share this process (imports dominate on two cores); SIGTERM comes from a thread that
watches ``metrics.jsonl``, and the loop's handler ends the step as a scheduler's signal would.
"""

from __future__ import annotations

import json
import re
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TIMING_PREFIXES = ("timing/", "time/", "run_id")


def sft_recipe(model_dir: Path, run_dir: Path) -> dict:
    return {
        "policy": {"model_name": str(model_dir), "precision": "float32", "max_total_sequence_length": 32,
                   "optimizer": {"lr": 3e-3, "weight_decay": 0.0}, "max_grad_norm": 1.0, "dtensor_cfg": {"enabled": True}},
        "algorithm": {"name": "sft"},
        "data": {"name": "arithmetic", "digits": 1, "num_train": 64, "num_validation": 16},
        "train": {"num_prompts_per_step": 8, "max_num_steps": 4, "val_period": 2, "val_at_start": True, "seed": 3,
                  "deterministic": True},
        "logger": {"log_dir": str(run_dir), "print_table": False},
        "checkpointing": {"enabled": True, "save_period": 1000, "keep_last_k": 1},
    }


def pair_recipe(file: str, model_dir: Path, run_dir: Path) -> dict:
    recipe = yaml.safe_load((ROOT / "recipes" / file).read_text())
    recipe["policy"]["model_name"] = str(model_dir)
    recipe["data"]["train_files"] = [str(ROOT / "recipes" / "data" / "preference_vowels.jsonl")]
    recipe["data"]["num_validation"] = 8
    recipe["train"] = {"num_prompts_per_step": 4, "max_num_steps": 4, "val_period": 2, "val_at_start": True,
                       "max_val_samples": 8, "seed": 3, "deterministic": True}
    recipe["logger"] = {"log_dir": str(run_dir), "print_table": False, "jsonl": {"enabled": True}}
    recipe["checkpointing"] = {"enabled": True, "save_period": 1000, "keep_last_k": 1}
    return recipe


RECIPES = {"sft": sft_recipe,
           "dpo": lambda model, run: pair_recipe("dpo_tiny_cpu.yaml", model, run),  # the fsdp2 backend
           "reward_model": lambda model, run: pair_recipe("rm_tiny_cpu.yaml", model, run)}  # its own trainer


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES)}


def cli_run(recipe: dict, path: Path, sigterm_after_step: int | None = None) -> int:
    """``rlcore run`` in this process; SIGTERM to it once ``metrics.jsonl`` holds that step."""
    from rlcore.cli.commands import main

    path.write_text(yaml.safe_dump(recipe))
    metrics = Path(recipe["logger"]["log_dir"]) / "metrics.jsonl"
    done = threading.Event()

    def send_sigterm():
        while not done.is_set():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
            if any(step >= sigterm_after_step for step in steps):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=send_sigterm, daemon=True) if sigterm_after_step is not None else None
    if watcher:
        watcher.start()
    try:
        return main(["run", str(path)])
    finally:
        done.set()


@pytest.fixture(scope="module")
def straight_runs(tiny_model_dir, tmp_path_factory):
    """Each loop run uninterrupted for 4 steps."""
    root = tmp_path_factory.mktemp("straight")
    out = {}
    for name, recipe in RECIPES.items():
        assert cli_run(recipe(tiny_model_dir, root / name), root / f"{name}.yaml") == 0
        out[name] = root / name
    return out


def test_sft_lowers_the_held_out_loss_and_writes_the_model(straight_runs):
    by_step = {r["step"]: r for r in records(straight_runs["sft"])}
    assert sorted(by_step) == [0, 1, 2, 3, 4]
    assert by_step[4]["val/loss"] < 0.6 * by_step[0]["val/loss"], (by_step[0]["val/loss"], by_step[4]["val/loss"])
    assert by_step[2]["val/loss"] < by_step[0]["val/loss"]
    assert by_step[1]["train/num_optimizer_steps"] == 1.0 and by_step[1]["train/response_tokens"] > 8
    summary = json.loads((straight_runs["sft"] / "summary.json").read_text())
    assert summary["val/loss_last"] == by_step[4]["val/loss"] and summary["stopped_by_signal"] is None
    # save_period 1000: the last step is checkpointed all the same
    assert sorted(p.name for p in (straight_runs["sft"] / "checkpoints").iterdir()) == ["step_000004"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(straight_runs["sft"] / "model").config.num_hidden_layers > 0


@pytest.mark.parametrize("name", list(RECIPES))
def test_sigterm_then_resume_equals_the_uninterrupted_run(name, straight_runs, tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / name
    recipe = RECIPES[name](tiny_model_dir, run_dir)
    assert cli_run(recipe, tmp_path / "recipe.yaml", sigterm_after_step=1) == 128 + signal.SIGTERM
    stopped = [r["step"] for r in records(run_dir)]
    last = stopped[-1]
    assert 1 <= last < 4 and stopped == list(range(last + 1)), stopped
    assert f"SIGTERM received: stopped after step {last}, checkpoint of step {last}" in capsys.readouterr().out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{last:06d}"]
    assert not (run_dir / "model").exists()  # a signalled run's model is in its checkpoint
    assert cli_run(recipe, tmp_path / "recipe.yaml") == 0
    out = capsys.readouterr().out
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{last:06d}'} at step {last}" in out
    # the end of the run says where its outputs went: the model and the last step's checkpoint
    assert f"outputs of this run in {run_dir}" in out and f"{run_dir / 'model'}" in out
    assert re.search(rf"checkpoint +{re.escape(str(run_dir / 'checkpoints' / 'step_000004'))}", out), out[-1500:]
    resumed, straight = records(run_dir), records(straight_runs[name])
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4], "each step once"
    assert len({r["run_id"] for r in resumed}) == 1
    for a, b in zip(straight, resumed):
        a, b = without_timings(a), without_timings(b)
        assert a.keys() == b.keys(), a["step"]
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
    assert (run_dir / "model" / "config.json").is_file()


def test_every_offline_step_record_carries_its_data_position(straight_runs):
    """As GRPO's: each step's batch is the range from the step before's position to its own."""
    for name, run_dir in straight_runs.items():
        steps = [r for r in records(run_dir) if r["step"] >= 1]
        assert [r["data_position"] for r in steps] == [4 * r["step"] if name != "sft" else 8 * r["step"] for r in steps], name


@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_a_packing_budget_below_one_sequence_is_refused_before_the_offline_run_starts(name, tiny_model_dir, tmp_path, capsys):
    """GRPO's check, made for every loop before the run directory is claimed or a model loads."""
    from rlcore.cli.commands import main

    recipe = RECIPES[name](tiny_model_dir, tmp_path / "run")
    recipe["policy"]["sequence_packing"] = {"enabled": True, "train_mb_tokens": 1}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(tmp_path / "recipe.yaml")]) == 2
    err = capsys.readouterr().err
    assert "error: config key 'policy.sequence_packing.train_mb_tokens': 1 tokens cannot hold one sequence" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_non_finite_losses_end_rlcore_run_with_one_line(name, tiny_model_dir, tmp_path, capsys):
    """A learning rate that overflows the weights after the first update: the next loss is not
    finite, and with train.max_consecutive_nonfinite=1 the run stops, saying so in one line."""
    from rlcore.cli.commands import main

    recipe = RECIPES[name](tiny_model_dir, tmp_path / "run")
    recipe["policy"]["optimizer"]["lr"] = 1e38
    recipe["policy"]["max_grad_norm"] = None
    recipe["train"].update(max_num_steps=3, max_consecutive_nonfinite=1, val_period=0, val_at_start=False)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.warns(UserWarning, match="non-finite loss"):
        assert main(["run", str(tmp_path / "recipe.yaml")]) == 1
    err = capsys.readouterr().err
    assert "error: NonFiniteLossError: 1 non-finite losses in a row (train.max_consecutive_nonfinite)" in err, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]


def test_a_malformed_data_row_ends_rlcore_run_with_one_message_and_status_2(tiny_model_dir, tmp_path, capsys):
    from rlcore.cli.commands import main

    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": \n{"problem": "3+3", "answer": "6"}\n')
    recipe = sft_recipe(tiny_model_dir, tmp_path / "run")
    recipe["data"] = {"name": "math_jsonl", "preset": "deepscaler", "train_files": [str(data)]}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(tmp_path / "recipe.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"error: {data}, line 2: invalid JSON" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
