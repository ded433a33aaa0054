"""``policy.megatron_cfg.cuda_graph: micro_batch`` on CPU: the graphs' fixed-shape path without capture.

On CPU there is no graph to capture, so the backend runs the same padded static buffers and the
same captured function directly (``cuda_graph_capture=False``). One 2-rank gloo launch
(cuda_graph_worker.py) trains two GRPO steps (KL, dual clip, truncated IS: every StepTotals use)
at DP=2 and at TP=2 with sequence parallelism (finalize_model_grads sums the norms' gradients),
once through Megatron's schedule and once through the graph path, and checks the refusals. The CUDA half (capture and replay) is in test_megatron_cuda.py.
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


@pytest.mark.parametrize("layout", ["dp2", "tp2_sp"])
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
    ("fp8_cfg.enabled", dict(fp8_cfg=MegatronFP8Config(enabled=True, fp8_recipe="tensorwise"))),
    ("core_attention", dict(core_attention="transformer_engine")),
    ("distributed_data_parallel_config.overlap_grad_reduce", dict(distributed_data_parallel_config=MegatronDDPConfig(overlap_grad_reduce=True))),
])
def test_config_refusals_name_both_keys(key, kwargs):
    with pytest.raises(ConfigError) as err:
        MegatronConfig(enabled=True, cuda_graph="micro_batch", **kwargs)
    assert err.value.key == f"policy.megatron_cfg.{key}" and KEY in str(err.value)
    MegatronConfig(enabled=True, **kwargs)  # allowed without graphs


def test_static_layout_pads_and_leaves_nothing_behind():
    """A longer then a shorter micro-batch through one bucket's buffers: the second one's padding
    overwrites everything the first left (tokens, mask, sequence indices and fields, rows, segments)."""
    import torch
    from rlcore.interfaces import SequenceBatch, StepTotals
    from rlcore.data.packing import make_micro_batches

    from rlcore_megatron.cuda_graph import StaticInputs, bucket_for

    def micro_batch(lengths):
        ids = [torch.arange(3, 3 + n) for n in lengths]
        batch = SequenceBatch(input_ids=ids, loss_mask=[torch.ones(n) for n in lengths],
                              token_fields={"old_logprobs": [-torch.ones(n) for n in lengths]},
                              seq_fields={"advantages": torch.arange(1.0, 1.0 + len(lengths))})
        return make_micro_batches(batch, 64)[0]

    long, short = micro_batch([20, 30]), micro_batch([15, 14, 17])
    tokens = 64
    assert bucket_for(long, tokens) == bucket_for(short, tokens)  # 2 and 3 sequences, 48 and 43 rows: one bucket
    static = StaticInputs(bucket_for(long, tokens), tokens, torch.device("cpu"))
    static.load(long, StepTotals(50, 2))
    static.load(short, StepTotals(43, 3))
    used, rows = short.num_tokens, short.logprob_rows_R.numel()
    assert torch.equal(static.ids_T1[:used], short.input_ids_T) and not static.ids_T1[used:].any()  # incl. the dropped slot
    assert not static.mask_T[used:].any() and (static.seq_index_T[used:] == -1).all()
    assert torch.equal(static.rows_R[:rows], short.logprob_rows_R) and (static.rows_R[rows:] == tokens - 1).all()
    assert static.cu_host.tolist() == [0, 15, 29, 46] + [tokens] * (static.bucket.segments - 3)
    assert static.seq_fields["advantages"].tolist() == [1.0, 2.0, 3.0] + [0.0] * (static.bucket.seqs - 3)
    assert (static.token_fields["old_logprobs"][used:] == 0).all() and static.totals_2.tolist() == [43.0, 3.0]
    assert static.params.max_seqlen_q == tokens + 1 and static.mb.num_seqs == static.bucket.seqs


def test_importing_the_worker_leaves_the_importers_gpu_and_transformer_engine_alone():
    """The worker hides the GPU and Transformer Engine from itself as a script only: test_megatron_cuda.py imports
    its helpers into a process that needs both (hidden there, every later CUDA test and vLLM engine failed)."""
    import os
    import subprocess
    import sys

    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); import cuda_graph_worker; "
            "print(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'), 'transformer_engine' in sys.modules "
            "and sys.modules['transformer_engine'] is None)")
    done = subprocess.run([sys.executable, "-c", code, str(WORKER.parent)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["0", "False"]
