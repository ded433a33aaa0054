"""``policy.megatron_cfg.cuda_graph: micro_batch`` on CPU: the graphs' fixed-shape path without capture.

On CPU there is no graph to capture, so the backend runs the same padded static buffers and the
same captured function directly (``cuda_graph_capture=False``). One 2-rank gloo launch
(cuda_graph_worker.py) trains two GRPO steps (KL, dual clip, truncated IS: every StepTotals use)
at DP=2 and at TP=2, once through Megatron's schedule and once through the graph path, and checks
the refusals. The CUDA half (capture and replay) is in test_megatron_cuda.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rlcore.config import ConfigError
from rlcore.testing.ranks import rank_results

from rlcore_megatron.config import MegatronConfig, MegatronDDPConfig, MegatronFP8Config, MegatronOptimizerConfig

WORKER = Path(__file__).with_name("cuda_graph_worker.py")
KEY = "policy.megatron_cfg.cuda_graph"


@pytest.fixture(scope="module")
def results(tiny_model_factory, tmp_path_factory):
    dense = str(tiny_model_factory("llama", hidden_size=256, num_heads=4, num_kv_heads=2))
    moe = str(tiny_model_factory("qwen3_moe", hidden_size=256, num_heads=4, num_kv_heads=2))
    out = tmp_path_factory.mktemp("megatron-cuda-graph")
    data = rank_results(WORKER, [dense, moe, out], out / "rank_0.json", what="cuda-graph workers", timeout=300)
    return data


def scenario(results, name):
    value = results[name]
    if isinstance(value, str) and value.startswith("ERROR"):
        pytest.fail(f"scenario {name} failed:\n{value}")
    return value


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_graph_path_equals_the_schedule(results, layout):
    r = scenario(results, layout)
    assert r["missing_metrics"] == [] and {"kl", "clip_fraction", "is_truncated_fraction", "rollout_ratio_max"} <= set(r["metric_keys"])
    assert r["loss_value"] != 0.0 and r["moved"] > 1e-4  # a real step: the weights moved
    assert r["shared_buckets"] >= 1  # one bucket's buffers served micro-batches of different lengths
    assert r["logprobs"] < 1e-6
    assert r["loss"] < 1e-6 and r["metrics"] < 1e-6 and r["grad_norm"] < 1e-6
    assert r["weights"] < 1e-6


def test_refusals_name_the_key(results):
    r = scenario(results, "refusals")
    for case in ("cpu_capture", "moe", "dpo"):
        assert KEY in r[case], (case, r[case])
    assert "needs CUDA" in r["cpu_capture"] and "mixture-of-experts" in r["moe"] and "'dpo'" in r["dpo"]


@pytest.mark.parametrize("key, kwargs", [
    ("pipeline_model_parallel_size", dict(pipeline_model_parallel_size=2)),
    ("context_parallel_size", dict(context_parallel_size=2)),
    ("activation_checkpointing", dict(activation_checkpointing="selective")),
    ("optimizer.fp16", dict(optimizer=MegatronOptimizerConfig(fp16=True))),
    ("fp8_cfg.fp8_recipe", dict(fp8_cfg=MegatronFP8Config(enabled=True, fp8_recipe="delayed"))),
    ("fp8_cfg.fp8_param", dict(fp8_cfg=MegatronFP8Config(enabled=True, fp8_param=True, fp8_logprobs=True))),
    ("core_attention", dict(core_attention="transformer_engine")),
    ("distributed_data_parallel_config.overlap_grad_reduce", dict(distributed_data_parallel_config=MegatronDDPConfig(overlap_grad_reduce=True))),
])
def test_config_refusals_name_both_keys(key, kwargs):
    with pytest.raises(ConfigError) as err:
        MegatronConfig(enabled=True, cuda_graph="micro_batch", **kwargs)
    assert err.value.key == f"policy.megatron_cfg.{key}" and KEY in str(err.value)
    MegatronConfig(enabled=True, **kwargs) if key != "fp8_cfg.fp8_param" else None  # allowed without graphs


def test_allowed_fp8_recipes():
    for recipe in ("tensorwise", "blockwise"):
        MegatronConfig(enabled=True, cuda_graph="micro_batch", fp8_cfg=MegatronFP8Config(enabled=True, fp8_recipe=recipe))
