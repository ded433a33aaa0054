"""Every trainer stops after ``train.max_consecutive_nonfinite`` steps in a row whose update was
skipped for a non-finite loss: the rollout loop's learner and the offline loop (SFT, DPO, the reward
model) alike; a finite step in between starts the count again, and the count survives a checkpoint."""

from __future__ import annotations

import pytest

from rlcore.config import ConfigError
from rlcore.loading.loader import build_config
from rlcore.controller.nonfinite import NonFiniteLossError, NonfiniteStreak
from rlcore.controller.offline import OfflineLoop, OfflineSteps


def test_the_streak_counts_skipped_steps_in_a_row_and_stops_at_the_limit():
    streak = NonfiniteStreak(3)
    with pytest.warns(UserWarning, match="step 1: non-finite loss"):
        assert streak.after_step(True, 1) is False
    assert streak.after_step(False, 2) is True and streak.in_a_row == 0
    with pytest.warns(UserWarning):
        streak.after_step(True, 3)
        streak.after_step(True, 4)
        with pytest.raises(NonFiniteLossError, match=r"3 non-finite losses in a row \(train.max_consecutive_nonfinite\)"):
            streak.after_step(True, 5)


POLICY = {"policy": {"model_name": "m", "generation": {"backend": "hf"}}}


def _offline_loop(skipped_steps: set[int], limit: int, tmp_path) -> OfflineLoop:
    config = build_config({**POLICY, "algorithm": {"name": "sft"}, "checkpointing": {"enabled": False},
                           "logger": {"log_dir": str(tmp_path)}},
                          [f"train.max_consecutive_nonfinite={limit}", "train.max_num_steps=8", "train.num_prompts_per_step=1"])
    step = iter(range(1, 100))

    def train(examples):
        return {"train/loss": 1.0, **({"train/skipped_nonfinite": 1.0} if next(step) in skipped_steps else {})}

    steps = OfflineSteps(train=train, evaluate=None, save_checkpoint=lambda path: None, load_checkpoint=lambda path: None)
    return OfflineLoop(config, {}, steps, list(range(10)), None, [], "sft", print_lines=False)


def test_an_offline_run_stops_after_the_limit_of_skipped_steps_in_a_row(tmp_path):
    loop = _offline_loop({2, 3, 5, 6}, limit=2, tmp_path=tmp_path)
    with pytest.warns(UserWarning), pytest.raises(NonFiniteLossError, match="2 non-finite losses in a row"):
        loop.run()
    assert loop.step == 3  # steps 2 and 3 in a row


def test_an_offline_run_with_skipped_steps_apart_goes_on(tmp_path):
    loop = _offline_loop({2, 4, 6}, limit=2, tmp_path=tmp_path)
    with pytest.warns(UserWarning):
        records = loop.run()
    assert [r["step"] for r in records] == list(range(1, 9))


def test_the_old_spelling_under_grpo_names_the_new_key():
    with pytest.raises(ConfigError, match=r"grpo.max_consecutive_nonfinite.*train.max_consecutive_nonfinite"):
        build_config({**POLICY, "grpo": {"max_consecutive_nonfinite": 2}})
