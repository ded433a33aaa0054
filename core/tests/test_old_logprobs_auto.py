"""``algorithm.use_old_logprobs: auto`` (the default): rlcore.run skips the old-logprob pass when
one optimizer step trains on each generated batch (sync or async), and runs it otherwise or when asked;
for an algorithm object passed to rlcore.run as for one built from the recipe."""

from __future__ import annotations

import pytest

import rlcore
from rlcore.algorithms.config import GRPOConfig
from rlcore.algorithms.grpo import GRPO
from rlcore.controller.task import build_algorithm, resolve_old_logprobs
from rlcore.interfaces import OldLogprobsChoice
from rlcore.plugins import get_plugin_manager


def _config(tmp_path, algorithm: dict | None = None, **policy_and_loop):
    policy = {"model_name": str(tmp_path), **policy_and_loop.pop("policy", {})}
    return rlcore.build_config({"policy": policy, "algorithm": algorithm or {"name": "grpo"},
                                "train": {"num_prompts_per_step": 4},
                                "grpo": {"num_generations_per_prompt": 2, **policy_and_loop}})


def _algorithm(tmp_path, algorithm: dict, **policy_and_loop):
    return build_algorithm(_config(tmp_path, algorithm, **policy_and_loop), get_plugin_manager())


@pytest.mark.parametrize("algorithm, setting, runs_pass", [
    ({"name": "grpo"}, {}, False),  # one sync step per batch: skipped
    ({"name": "gspo"}, {"policy": {"train_global_batch_size": 8}}, False),  # = P*G: still one step
    ({"name": "grpo"}, {"policy": {"train_global_batch_size": 4}}, True),  # two optimizer steps per batch
    ({"name": "dapo"}, {"async_grpo": {"enabled": True}}, False),  # async, one step: old = the weights it starts at
    ({"name": "dapo"}, {"async_grpo": {"enabled": True}, "policy": {"train_global_batch_size": 4}}, True),
    ({"name": "grpo", "use_old_logprobs": True}, {}, True),  # asked for
    ({"name": "grpo", "use_old_logprobs": False}, {"async_grpo": {"enabled": True}}, False),  # refused
])
def test_auto_decides_whether_the_old_logprob_pass_runs(tmp_path, algorithm, setting, runs_pass, capsys):
    built = _algorithm(tmp_path, algorithm, **setting)
    assert built.uses_old_logprobs is runs_pass
    assert ("old_logprobs" in built.required_fields()) is runs_pass
    assert f"old-logprob pass {'runs' if runs_pass else 'skipped'}" in capsys.readouterr().out


def test_an_algorithm_without_the_key_is_built_as_is(tmp_path):
    assert not _algorithm(tmp_path, {"name": "sft"}).uses_old_logprobs


def test_the_key_takes_auto_true_false_only(tmp_path):
    with pytest.raises(rlcore.ConfigError, match="algorithm.use_old_logprobs"):
        _algorithm(tmp_path, {"name": "grpo", "use_old_logprobs": "sometimes"})


class _DeclaresItsOwn(GRPO):
    """A third-party algorithm object that reads old logprobs for its own reasons: it has no
    choose_old_logprobs, so the pass runs whatever the run's shape."""

    choose_old_logprobs = None


@pytest.mark.parametrize("setting, runs_pass", [({}, False), ({"policy": {"train_global_batch_size": 4}}, True),
                                                ({"async_grpo": {"enabled": True}}, False)])
def test_a_passed_algorithm_object_is_decided_like_a_built_one(tmp_path, setting, runs_pass):
    passed = GRPO(GRPOConfig(kl_coef=0.0))  # use_old_logprobs: auto
    assert isinstance(passed, OldLogprobsChoice) and passed.uses_old_logprobs  # undecided: the pass runs
    assert resolve_old_logprobs(_config(tmp_path, **setting), passed) is passed
    assert passed.uses_old_logprobs is runs_pass
    assert ("old_logprobs" in passed.required_fields()) is runs_pass


def test_a_passed_object_keeps_an_explicit_setting_and_one_without_the_choice_keeps_its_own(tmp_path):
    config = _config(tmp_path)  # one sync step per batch: auto would skip the pass
    assert resolve_old_logprobs(config, GRPO(GRPOConfig(use_old_logprobs=True))).uses_old_logprobs
    own = _DeclaresItsOwn()
    assert not isinstance(own, OldLogprobsChoice)
    assert resolve_old_logprobs(config, own).uses_old_logprobs
