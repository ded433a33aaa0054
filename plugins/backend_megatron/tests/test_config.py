"""policy.megatron_cfg schema and combination checks (no torch, no megatron)."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from rlcore.config import ConfigError, structure
from rlcore import build_config
from rlcore_megatron.config import SECTION, MegatronConfig, validate_parallelism


def make(**data) -> MegatronConfig:
    return structure(MegatronConfig, data, SECTION)


def test_defaults_work_on_one_process():
    cfg = make()
    assert cfg.enabled is False and cfg.tensor_model_parallel_size == 1
    assert validate_parallelism(cfg, 1, num_layers=2) == 1
    assert cfg.recompute is None and make(activation_checkpointing=True).recompute == "full"
    assert make(activation_checkpointing="selective").recompute == "selective"


def test_nested_blocks_and_unknown_keys_name_the_path():
    cfg = make(optimizer={"lr": 1e-5, "clip_grad": 0.5}, scheduler={"lr_warmup_iters": 3},
               distributed_data_parallel_config={"grad_reduce_in_fp32": False})
    assert cfg.optimizer.lr == 1e-5 and cfg.scheduler.lr_warmup_iters == 3
    assert make().optimizer.adam_beta1 is None  # unset: taken from policy.optimizer when the backend is built
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.tensor_model_parallel_sise.*tensor_model_parallel_size"):
        make(tensor_model_parallel_sise=2)
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.optimizer\.lrr"):
        make(optimizer={"lrr": 1.0})
    with pytest.raises(ConfigError, match=r"average_in_collective"):
        make(distributed_data_parallel_config={"average_in_collective": True})
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.sequence_parallel"):
        make(sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size"):
        make(tensor_model_parallel_size=0)


@pytest.mark.parametrize("kwargs, world, message", [
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 6, r"tensor_model_parallel_size \(2\) x pipeline_model_parallel_size \(2\).*world size 6"),
    (dict(pipeline_model_parallel_size=3), 3, r"pipeline_model_parallel_size.*3 stages do not divide the model's 4 layers"),
    (dict(expert_model_parallel_size=2), 2, r"expert_model_parallel_size.*dense"),
    (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=4), 2, r"num_layers_in_first_pipeline_stage"),
])
def test_invalid_combinations_name_the_keys(kwargs, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_parallelism(make(**kwargs), world, num_layers=4)


def test_context_parallel_needs_packing_and_uneven_stages_pass():
    with pytest.raises(ConfigError, match=r"context_parallel_size.*sequence_packing"):
        validate_parallelism(make(context_parallel_size=2), 2, num_layers=4, packing=False)
    cfg = make(pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1)
    assert validate_parallelism(cfg, 6, num_layers=4) == 2
    assert validate_parallelism(make(expert_model_parallel_size=2), 2, num_layers=2, num_experts=4) == 2
    with pytest.raises(ConfigError, match=r"megatron_cfg\.expert_tensor_parallel_size.*needs expert_model_parallel_size > 1"):
        validate_parallelism(make(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1), 2,
                             num_layers=2, num_experts=4)
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.sequence_parallel.*mixture-of-experts"):
        validate_parallelism(make(tensor_model_parallel_size=2), 2, num_layers=2, num_experts=4)


def test_registered_with_precedence_and_selected_by_section(tmp_path):
    from rlcore.plugins import PluginManager
    from rlcore_megatron import plugin

    manager = PluginManager()
    manager.register_module(plugin)
    reg = manager.get("training_backend", "megatron")
    assert reg.section == "policy.megatron_cfg" and reg.capabilities["precedence"] == 10
    assert isinstance(reg.factory, str) and reg.factory.startswith("rlcore_megatron.")
    config = build_config({"policy": {"model_name": str(tmp_path)}}, ["policy.megatron_cfg.enabled=true",
                          "policy.megatron_cfg.activation_checkpointing=selective"], manager)
    assert config.section(SECTION).enabled and config.section(SECTION).recompute == "selective"


def test_plugin_import_stays_torch_free():
    code = "import sys, rlcore_megatron.plugin, rlcore_megatron.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_gemm_sm_margin_is_an_experimental_count_of_sms():
    assert make().experimental.gemm_sm_margin == 0
    assert make(experimental={"gemm_sm_margin": 20}).experimental.gemm_sm_margin == 20
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.experimental\.gemm_sm_margin"):
        make(experimental={"gemm_sm_margin": -1})
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.gemm_sm_margin"):
        make(gemm_sm_margin=20)  # not a top-level key


def test_cuda_graph_doc_agrees_with_its_fp8_refusal():
    """The key's doc names FP8 as excluded, as the check refuses it."""
    from rlcore_megatron.config import MegatronConfig as M

    assert "no FP8" in attrs.fields(M).cuda_graph.metadata["doc"]
    with pytest.raises(ConfigError, match=r"fp8_cfg\.enabled"):
        make(cuda_graph="micro_batch", fp8_cfg={"enabled": True})


def test_kernels_resolve_per_device_and_refuse_what_cannot_run():
    from rlcore_megatron.kernels import resolve

    cpu = resolve(make(), on_cuda=False)
    assert not cpu.transformer_engine and cpu.core_attention == "flash" and cpu.token_multiple == 1
    assert not (cpu.rope_fusion or cpu.swiglu_fusion or cpu.wgrad_fusion) and cpu.fp8 is None
    assert resolve(make(transformer_impl="local"), on_cuda=True).swiglu_fusion  # fused SwiGLU is Megatron's own kernel
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.transformer_impl.*needs a CUDA device"):
        resolve(make(transformer_impl="transformer_engine"), on_cuda=False)
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.fp8_cfg\.enabled.*Transformer Engine"):
        resolve(make(transformer_impl="local", fp8_cfg={"enabled": True}), on_cuda=True)
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.core_attention"):
        resolve(make(core_attention="transformer_engine"), on_cuda=False)
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.bias_activation_fusion.*CUDA"):
        resolve(make(bias_activation_fusion=True), on_cuda=False)


def test_transformer_engine_that_does_not_load_is_a_config_error(monkeypatch):
    from rlcore_megatron import kernels

    monkeypatch.setattr(kernels, "transformer_engine", lambda: {"version": "2.20.2", "loads": False, "error": "OSError: libcuda.so.1"})
    assert not kernels.resolve(make(), on_cuda=True).transformer_engine  # auto falls back to the local spec
    with pytest.raises(ConfigError, match=r"transformer_impl.*does not load \(OSError: libcuda\.so\.1\).*rlcore doctor"):
        kernels.resolve(make(transformer_impl="transformer_engine"), on_cuda=True)
    monkeypatch.setattr(kernels, "transformer_engine", lambda: {"version": "2.20.2", "loads": True, "error": None})
    te = kernels.resolve(make(fp8_cfg={"enabled": True, "fp8_recipe": "blockwise"}), on_cuda=True)
    assert te.transformer_engine and te.rope_fusion and te.wgrad_fusion and te.swiglu_fusion and te.token_multiple == 128
    assert "fp8 hybrid/blockwise" in te.describe()


def test_fp8_keys():
    cfg = make(fp8_cfg={"enabled": True, "fp8": "e4m3", "fp8_recipe": "delayed"})
    assert cfg.fp8_cfg.fp8 == "e4m3" and cfg.fp8_cfg.token_multiple == 16 and not cfg.fp8_cfg.fp8_logprobs
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.fp8_cfg\.fp8_recipe"):
        make(fp8_cfg={"fp8_recipe": "mxfp8"})
    with pytest.raises(ConfigError, match=r"fp8_cfg\.fp8_logprobs.*fp8_param"):
        make(fp8_cfg={"enabled": True, "fp8_param": True})
