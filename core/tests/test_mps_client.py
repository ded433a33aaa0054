"""``experimental.trainer_mps_priority``: where it cannot take effect the run stops before any work, naming the key;
on a GPU with an MPS daemon the trainer's context is made with it and the engine's environment keeps none."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import rlcore
from rlcore.config import ConfigError
from rlcore.controller.mps_client import enter_mps_client, mps_control_pipe
from rlcore.controller.engines import build_trainer
from rlcore.interfaces import Placement
from rlcore.plugins import get_plugin_manager

ONE_GPU = Placement(device="cuda", trainer_ranks=1, use_ray=False, colocated=True, generator_gpus=0)


def test_unset_key_leaves_cuda_alone():
    enter_mps_client(None, Placement(device="cpu", trainer_ranks=1, use_ray=False, colocated=True, generator_gpus=0))
    assert "CUDA_MPS_CLIENT_PRIORITY" not in os.environ


def test_a_cpu_run_with_the_key_stops_before_its_trainer_is_built(tmp_path):
    config = rlcore.build_config({
        "policy": {"model_name": str(tmp_path / "no-model")}, "algorithm": {"name": "grpo"},
        "data": {"name": "arithmetic"}, "env": {"name": "math"},
        "experimental": {"trainer_mps_priority": "below_normal"},
    })
    placement = Placement(device="cpu", trainer_ranks=1, use_ray=False, colocated=True, generator_gpus=0)
    with pytest.raises(ConfigError, match=r"experimental\.trainer_mps_priority.*no GPU"):
        build_trainer(config, get_plugin_manager(), placement)


def test_ray_trainer_ranks_are_refused():
    ranks = Placement(device="cuda", trainer_ranks=2, use_ray=True, colocated=True, generator_gpus=0)
    with pytest.raises(ConfigError, match=r"experimental\.trainer_mps_priority.*Ray workers"):
        enter_mps_client("below_normal", ranks)


def test_an_unknown_priority_is_named():
    with pytest.raises(ConfigError, match=r"experimental\.trainer_mps_priority.*'high'"):
        enter_mps_client("high", ONE_GPU)


def test_without_a_daemon_the_error_names_its_pipe_and_how_to_start_one(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    with pytest.raises(ConfigError, match=rf"no MPS daemon.*{tmp_path}/control.*nvidia-cuda-mps-control -d"):
        enter_mps_client("below_normal", ONE_GPU)
    assert "CUDA_MPS_CLIENT_PRIORITY" not in os.environ


def test_the_pipe_is_found_where_the_daemon_puts_it():
    assert str(mps_control_pipe({})) == "/tmp/nvidia-mps/control"
    assert str(mps_control_pipe({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"})) == "/run/mps/control"


CHILD = r"""
import os, subprocess, sys, torch
from rlcore.config import ConfigError
from rlcore.controller.mps_client import enter_mps_client
from rlcore.interfaces import Placement
gpu = Placement(device="cuda", trainer_ranks=1, use_ray=False, colocated=True, generator_gpus=0)
enter_mps_client("below_normal", gpu)
assert torch.cuda.is_initialized()
assert "CUDA_MPS_CLIENT_PRIORITY" not in os.environ
engine_env = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('CUDA_MPS_CLIENT_PRIORITY'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
assert engine_env == "None", engine_env
enter_mps_client("below_normal", gpu)  # a second run in this process, at the same priority
try:
    enter_mps_client("normal", gpu)
except ConfigError as e:
    assert "exists already" in str(e)
else:
    raise AssertionError("another priority for the existing context passed")
print("ok")
"""


@pytest.mark.skipif(not mps_control_pipe().exists(), reason="needs a GPU with an MPS daemon (nvidia-cuda-mps-control -d)")
def test_the_trainer_context_is_an_mps_client_and_the_engine_inherits_no_priority():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
