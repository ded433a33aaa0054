"""rlcore_megatron.moe_splits on CPU: the dispatcher that keeps the experts' token counts where they
are computed (no device-to-host copy, no sort by local expert with one rank) gives the same logprobs
and the same training step as Megatron's own all-to-all dispatcher, bit for bit in fp32. The
experts half (TE's grouped-tensor GEMM) needs a GPU: test_megatron_moe_cuda.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import SumNLL, backend_for, make_batch  # noqa: E402

from rlcore.config import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def moe_path(tiny_model_factory):
    return str(tiny_model_factory("qwen3_moe"))


def test_device_splits_dispatcher_equals_megatrons(single_process_group, moe_path):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from rlcore_megatron.moe_splits import DeviceSplitsAlltoAllDispatcher, keep_splits_on_device

    results = {}
    for name in ("megatron", "device_splits"):
        backend = backend_for(moe_path)
        if name == "device_splits":
            assert keep_splits_on_device(backend.module) == 2  # one dispatcher per MoE layer
        kinds = {type(m.token_dispatcher) for m in backend.module.modules() if hasattr(m, "token_dispatcher")}
        assert kinds == {DeviceSplitsAlltoAllDispatcher if name == "device_splits" else MoEAlltoAllTokenDispatcher}
        logprobs = backend.logprobs(make_batch(3, n=8))
        metrics = backend.train(make_batch(4, n=8), SumNLL())
        after = backend.logprobs(make_batch(3, n=8))
        results[name] = logprobs, metrics, after
        backend.shutdown()
    (lp_m, met_m, after_m), (lp_d, met_d, after_d) = results["megatron"], results["device_splits"]
    assert all(torch.equal(a, b) for a, b in zip(lp_m, lp_d))
    assert met_m["loss"] == met_d["loss"] and met_m["grad_norm"] == met_d["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(after_m, after_d))
    assert not all(torch.equal(a, b) for a, b in zip(lp_m, after_m))  # the step moved the weights


def test_device_splits_kernel_resolution(monkeypatch):
    from rlcore.config import structure
    from rlcore_megatron import kernels
    from rlcore_megatron.config import SECTION, MegatronConfig

    def make(**data):
        return structure(MegatronConfig, data, SECTION)

    assert not kernels.resolve(make(), on_cuda=False).moe_device_splits
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.moe_device_splits.*needs Transformer Engine"):
        kernels.resolve(make(moe_device_splits=True), on_cuda=False)
    monkeypatch.setattr(kernels, "transformer_engine", lambda: {"version": "2.20.2", "loads": True, "error": None})
    te = kernels.resolve(make(), on_cuda=True)
    assert te.moe_device_splits and "grouped GEMM (device split sizes)" in te.describe()
    assert not kernels.resolve(make(moe_device_splits=False), on_cuda=True).moe_device_splits
    assert not kernels.resolve(make(fp8_cfg={"enabled": True}), on_cuda=True).moe_device_splits
    with pytest.raises(ConfigError, match=r"moe_device_splits.*FP8 experts pad"):
        kernels.resolve(make(moe_device_splits=True, fp8_cfg={"enabled": True}), on_cuda=True)
    with pytest.raises(ConfigError, match=r"moe_device_splits.*needs moe_grouped_gemm"):
        kernels.resolve(make(moe_device_splits=True, moe_grouped_gemm=False), on_cuda=True)
