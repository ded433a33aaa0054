"""MoE keys of ``policy.megatron_cfg``: they reach Megatron's ``TransformerConfig``, kernels resolve
like the other fusions, and what Megatron (or rlcore) cannot do is a ConfigError naming the key."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from rlcore.config import ConfigError, structure
from rlcore.testing.tiny import tiny_config
from rlcore_megatron.config import SECTION, MegatronConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import SumNLL, backend_for, make_batch  # noqa: E402


def make(**data) -> MegatronConfig:
    return structure(MegatronConfig, data, SECTION)


def tconfig(cfg: MegatronConfig, arch: str = "qwen3_moe"):
    from rlcore_megatron.kernels import resolve
    from rlcore_megatron.model import transformer_config

    return transformer_config(tiny_config(arch), cfg, resolve(cfg, on_cuda=False), params_dtype=torch.float32, on_cpu=True)


def test_moe_keys_reach_megatrons_transformer_config():
    t = tconfig(make(moe_router_dtype="fp64", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                     moe_router_replay="r2"))
    assert (t.num_moe_experts, t.moe_router_topk, t.moe_ffn_hidden_size) == (4, 2, 128)
    assert t.moe_router_dtype == "fp64" and t.moe_router_load_balancing_type == "aux_loss" and t.moe_aux_loss_coeff == 0.01
    assert t.moe_enable_routing_replay and t.moe_token_dispatcher_type == "alltoall"
    # the local spec (CPU) keeps the loop over experts and unfused permutes
    assert not t.moe_grouped_gemm and not t.moe_permute_fusion
    t = tconfig(make())
    assert t.moe_router_dtype == "fp32" and t.moe_aux_loss_coeff == 0.0 and not t.moe_enable_routing_replay
    assert tconfig(make(moe_routing_metrics=True)).moe_enable_routing_replay


def test_grouped_gemm_and_permute_fusion_follow_transformer_engine(monkeypatch):
    from rlcore_megatron import kernels

    cpu = kernels.resolve(make(), on_cuda=False)
    assert not cpu.moe_grouped_gemm and not cpu.moe_permute_fusion
    assert "MoE experts: loop over experts, permute fusion off" in cpu.describe()
    for key in ("moe_grouped_gemm", "moe_permute_fusion"):
        with pytest.raises(ConfigError, match=rf"policy\.megatron_cfg\.{key}.*needs Transformer Engine"):
            kernels.resolve(make(**{key: True}), on_cuda=False)
    monkeypatch.setattr(kernels, "transformer_engine", lambda: {"version": "2.20.2", "loads": True, "error": None})
    te = kernels.resolve(make(), on_cuda=True)
    assert te.moe_grouped_gemm and te.moe_permute_fusion and "grouped GEMM (device split sizes), permute fusion on" in te.describe()
    assert not kernels.resolve(make(moe_grouped_gemm=False), on_cuda=True).moe_grouped_gemm


@pytest.mark.parametrize("data, key, message", [
    (dict(moe_token_dispatcher_type="allgather"), "moe_token_dispatcher_type", r"variable sequence lengths"),
    (dict(moe_router_replay="r4"), "moe_router_replay", r"r4"),
])
def test_schema_errors_name_the_key(data, key, message):
    with pytest.raises(ConfigError, match=rf"policy\.megatron_cfg\.{key}.*{message}"):
        make(**data)


@pytest.mark.parametrize("data, arch, key, message", [
    (dict(moe_router_bias_update_rate=1e-3), "qwen3_moe", "moe_router_bias_update_rate", r"sigmoid.*softmax"),
    (dict(moe_aux_loss_coeff=0.01), "qwen3_moe", "moe_aux_loss_coeff", r"aux_loss"),
    (dict(moe_router_replay="r2"), "llama", "moe_router_replay", r"dense"),
    (dict(moe_routing_metrics=True), "qwen3", "moe_routing_metrics", r"dense"),
    (dict(moe_router_replay="r2", moe_router_load_balancing_type="sinkhorn"), "qwen3_moe", "moe_router_replay", r"sinkhorn"),
])
def test_combinations_megatron_would_refuse_name_the_key(data, arch, key, message):
    with pytest.raises(ConfigError, match=rf"policy\.megatron_cfg\.{key}.*{message}"):
        tconfig(make(**data), arch)


def test_replay_without_the_steps_old_logprob_pass_is_an_error(single_process_group, tiny_model_factory):
    """R2 (and the mismatch measure) read the routing of the step's old-logprob pass; a run that
    skips it (use_old_logprobs: auto, one optimizer step per batch) gets an error, not a silent no-op."""
    backend = backend_for(str(tiny_model_factory("qwen3_moe")), moe_router_replay="r2")
    batch, other = make_batch(4, n=8), make_batch(5, n=4)
    with pytest.raises(ConfigError, match=r"moe_router_replay.*old-logprob pass.*had none.*use_old_logprobs: true"):
        backend.train(batch, SumNLL())
    backend.logprobs(batch)
    assert math.isfinite(backend.train(batch, SumNLL())["loss"])
    backend.logprobs(other)  # a pass over other sequences, like the refit probe's
    with pytest.raises(ConfigError, match="moe_router_replay"):
        backend.train(batch, SumNLL())
    backend.shutdown()
