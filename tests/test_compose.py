"""Objects passed to ``rlcore.run`` replace the plugin lookups: ``examples/compose.py`` runs with
the math plugin disabled, and a passed object that lacks a method fails at once, naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlcore
from rlcore.controller.given import check_given
from rlcore.interfaces.members import REQUIRED

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "compose.py"


@pytest.mark.slow
def test_compose_example_runs_two_steps_without_the_math_plugin(tmp_path):
    env = {**os.environ, "RLCORE_DISABLE_PLUGINS": "math"}
    done = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 1: reward" in done.stdout and "step 2: reward" in done.stdout and "2 GRPO steps" in done.stdout
    # The passed GRPO object's use_old_logprobs: auto is decided as a recipe's would be (one sync step per batch).
    assert "algorithm mean_baseline_grpo: old-logprob pass skipped" in done.stdout
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2


def test_every_required_member_is_in_its_protocol():
    for kind, (protocol, members) in REQUIRED.items():
        declared = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
        assert {m.removesuffix("()") for m in members} <= declared, kind


class _StepOnly:
    def step(self, samples, histories):
        return []


def test_a_passed_object_missing_a_method_is_named():
    with pytest.raises(TypeError, match=r"rlcore.run\(environment=...\): object has no step\(\)"):
        check_given({"environment": object()})
    with pytest.raises(TypeError, match=r"rlcore.run\(dataset=...\): _StepOnly has no train \(nor validation\)"):
        check_given({"dataset": _StepOnly(), "environment": _StepOnly()})
    with pytest.raises(TypeError, match=r"loggers\[0\]: _StepOnly has no log\(\) \(nor close\(\)\)"):
        check_given({"loggers": [_StepOnly()]})
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['enviroment'\]"):
        check_given({"enviroment": _StepOnly()})


def test_run_refuses_a_bad_object_before_claiming_the_run_dir(tmp_path):
    config = rlcore.build_config({"policy": {"model_name": str(tmp_path / "absent"), "dtensor_cfg": {"enabled": True}},
                                  "logger": {"log_dir": str(tmp_path / "run")}})
    with pytest.raises(TypeError, match=r"algorithm=...\): _StepOnly has no name"):
        rlcore.run(config, algorithm=_StepOnly())
    assert not (tmp_path / "run").exists()
