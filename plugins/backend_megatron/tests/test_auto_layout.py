"""``layout: auto`` on CPU over gloo: the layouts the planner picks for the tiny dense and MoE models at 2,
4 and 8 ranks are valid Megatron layouts (without processes), and at 2 and 4 ranks train a step equal to one
plain PyTorch step.

One spawned group per rank count (auto_layout_worker.py). The tiny models have 4 query / 2 key-value
heads, 2 layers and (MoE) 4 experts, so tensor, pipeline and expert parallelism are all candidates; for
models this small the planner picks data parallelism, and a third case sets tensor and expert parallel
sizes to check that the keys a section sets are kept and what they imply is filled in.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from rlcore.testing.ranks import run_ranks
from rlcore_megatron.config import validate_parallelism

WORKER = Path(__file__).with_name("auto_layout_worker.py")


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    return {a: str(tiny_model_factory(a, hidden_size=256, num_heads=4, num_kv_heads=2)) for a in ("llama", "qwen3_moe")}


def _run(models, tmp_path, world: int) -> dict:
    from rlcore.utils import free_port

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    logs = run_ranks(WORKER, [str(free_port()), json.dumps(models), str(tmp_path)], what=f"auto layout x{world}",
                     timeout=600, world_size=world, env=env)
    data = json.loads((tmp_path / "rank_0.json").read_text())
    errors = {k: v for k, v in data.items() if isinstance(v, str) and v.startswith("ERROR")}
    assert not errors, errors
    chose = [line for line in logs[0].splitlines() if "layout: auto chose" in line]
    assert len(chose) == 3, logs[0][-3000:]  # one report per case, from rank 0 only
    return data


def _check(data: dict, world: int) -> None:
    for case in ("dense", "moe", "moe_tp2_ep2"):
        tp, pp, cp, ep = (data[f"{case}_{k}"] for k in ("tp", "pp", "cp", "ep"))
        assert data[f"{case}_groups"][:4] == [tp, pp, cp, ep]  # Megatron built the groups the config names
        assert data[f"{case}_groups"][4] * tp * pp * cp == world
        # fp32 on CPU: the parallel step's loss and weights equal one process's (reduction order only).
        # Loss: a mean over ~150 loss tokens (make_batch(n=16)) of |A * logp| ~ 1, N * eps32 ~ 2e-5.
        # Weights after one Adam step (lr 1e-3, adam_eps 1e-6, auto_layout_worker): rounding of near-zero
        # gradients moves a weight by up to ~5% of lr (test_distributed.WEIGHTS_TOL); no or a wrong update, ~lr.
        assert data[f"{case}_loss_diff"] < 2e-5
        assert data[f"{case}_weight_diff"] < 0.05 * 1e-3
    # the keys the section sets are kept; the planner fills in what they imply (sequence parallel, expert TP)
    assert (data["moe_tp2_ep2_tp"], data["moe_tp2_ep2_ep"], data["moe_tp2_ep2_sp"]) == (2, 2, True)
    print(f"{world} ranks:", {c: [data[f"{c}_{k}"] for k in ("tp", "pp", "cp", "ep", "etp", "sp", "recompute")]
                              for c in ("dense", "moe", "moe_tp2_ep2")})


@pytest.mark.distributed
@pytest.mark.slow  # 2 ranks: about 30 s on 2 loaded cores, 4 ranks about 60 s
# Four ranks put data parallelism beside the third case's TP=2 and EP=2; eight (64-84 s on two cores) only widen that
# data parallelism, so the planner's choices at 8 are checked without processes (below).
@pytest.mark.parametrize("world", [2, 4])
def test_auto_layout_trains(models, tmp_path, world):
    _check(_run(models, tmp_path, world), world)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_auto_layout_is_valid_for_megatron(arch, world):
    """The same choice without processes (the planner is arithmetic): Megatron's own checks accept it."""
    sys.path.insert(0, str(Path(__file__).parent))
    from auto_layout_worker import run_config
    from rlcore.testing.tiny import tiny_config
    from rlcore_megatron.config import apply_auto_layout

    hf = tiny_config(arch, hidden_size=256, num_heads=4, num_kv_heads=2)
    for keys in ({}, {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2} if arch == "qwen3_moe" else {"pipeline_model_parallel_size": 2}):
        run = run_config("/not/read", keys)
        cfg = apply_auto_layout(run.section("policy.megatron_cfg"), run, hf.to_dict(), world, "cpu", report=lambda _: None)
        dp = validate_parallelism(cfg, world, num_layers=hf.num_hidden_layers, num_experts=getattr(hf, "num_experts", None),
                                  num_query_groups=hf.num_key_value_heads, num_heads=hf.num_attention_heads)
        assert dp * cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size * cfg.context_parallel_size == world
        for key, value in keys.items():
            assert getattr(cfg, key) == value
