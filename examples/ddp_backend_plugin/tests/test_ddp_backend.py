"""rlcore's training-backend conformance suite against the ``ddp`` backend (built through its
entry point, in this process, on a world-size-1 gloo group), and a 2-rank step that must equal
the 1-rank step on the same batch (gradients summed over ranks, not averaged)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.testing.conformance import TrainingBackendConformance

from ddp_common import build, grpo, make_batch, run_config

HERE = Path(__file__).resolve().parent


# single_process_group and tiny_model_dir: fixtures of rlcore.testing's pytest plugin.
class TestDDPConformance(TrainingBackendConformance):
    logprob_atol = 1e-5  # fp32, the same sdpa kernels as transformers

    @pytest.fixture(scope="class")
    def backend_model_dir(self, tiny_model_dir):
        return tiny_model_dir

    @pytest.fixture(scope="class")
    def training_backend(self, single_process_group, backend_model_dir):
        from rlcore.interfaces import WorldInfo

        backend = build(run_config(backend_model_dir), WorldInfo())
        yield backend
        backend.shutdown()


def test_registered_section_selects_the_backend():
    from rlcore.plugins import get_plugin_manager

    reg = get_plugin_manager().get("training_backend", "ddp")
    assert reg.section == "policy.ddp_cfg" and reg.capabilities["precedence"] > 0
    assert run_config("m").section("policy.ddp_cfg").enabled


def test_two_ranks_step_equals_one_rank_step(single_process_group, tiny_model_dir, tmp_path):
    import torch

    from rlcore.interfaces import WorldInfo

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(HERE / "ddp_two_rank_worker.py"),
                             str(tiny_model_dir), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    two_params = torch.load(tmp_path / "params.pt", weights_only=True)
    two = json.loads((tmp_path / "metrics.json").read_text())

    backend = build(run_config(tiny_model_dir), WorldInfo())
    batch = make_batch()
    batch.token_fields["old_logprobs"] = backend.logprobs(batch)
    one = backend.train(batch, grpo())
    assert two["num_micro_batches"] < one["num_micro_batches"]  # each rank took its share
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    for name, param in backend.model.named_parameters():
        diff = float((two_params[name] - param.detach()).abs().max())
        assert diff < 1e-5, f"{name}: the 2-rank step differs from the 1-rank step by {diff}"
    backend.shutdown()
