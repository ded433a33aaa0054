"""MoE routing replay R2 (``policy.megatron_cfg.moe_router_replay``) on CPU, gloo, 2 ranks.

One launch runs every scenario (routing_replay_worker.py): a tiny Qwen3-MoE (4 experts, top-2),
an old-logprob pass, then one ``train`` call of two optimizer steps with other micro-batches than
the logprob pass's. Forward hooks on every router give the expert set each token got in each
call; the test compares them, token by token, with the logprob pass's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rlcore.testing.ranks import rank_results

WORKER = Path(__file__).with_name("routing_replay_worker.py")
REPLAYED = ("ep2_r2", "ep1_r2_full_recompute", "cp2_r2", "tp2_sp_ep2_r2", "ep2_r2_grouped_mm")


@pytest.fixture(scope="module")
def results(tiny_model_factory, tmp_path_factory):
    model = str(tiny_model_factory("qwen3_moe", hidden_size=256, num_heads=4, num_kv_heads=2))
    out = tmp_path_factory.mktemp("megatron-replay")
    data = rank_results(WORKER, [model, out], out / "rank_0.json", what="routing replay workers", timeout=300)
    print({k: round(v, 1) for k, v in data.items() if k.endswith("_s")})
    return data


def scenario(results, name):
    value = results[name]
    if isinstance(value, str):
        pytest.fail(f"scenario {name} failed:\n{value}")
    return value


@pytest.mark.parametrize("name", REPLAYED)
def test_replay_trains_with_the_recorded_experts_of_every_token(results, name):
    # EP=2, EP=1 with full recompute (the recomputed forward replays too), CP=2, TP=2+SP with EP=2,
    # EP=2 with torch grouped GEMM experts;
    # logprob and training micro-batches packed differently, two optimizer steps.
    r = scenario(results, name)
    assert r["optimizer_steps"] == 2.0
    assert r["tokens"] > 100 and r["train_calls"] >= r["tokens"]
    assert r["differing_calls"] == 0  # one token routed differently from its recorded experts fails this
    # ... while the router's own choice did differ after the first optimizer step: replay mattered
    assert r["mismatch_fraction"] > 0.0 and r["mismatched"] > 0
    assert r["compared"] == r["train_calls"] / (2 if "recompute" in name else 1)


def test_without_replay_the_trainer_routes_differently_and_the_metric_counts_it(results):
    r = scenario(results, "ep2_no_replay")
    assert r["differing_calls"] > 0
    assert r["mismatched"] == r["differing_calls"]  # the metric counts exactly the tokens that routed differently
    assert r["compared"] == r["train_calls"]


def test_aux_loss_coefficient_and_frozen_router_reach_the_training_step(results):
    # EP=2, one step from the same weights: the aux loss changes the router's update, a frozen
    # router does not move while the rest of the model does.
    r = scenario(results, "moe_keys")
    assert r["none_router_moved"] > 1e-4
    assert r["aux_vs_none_router"] > 1e-6
    assert r["frozen_router_moved"] == 0.0 and r["frozen_others_moved"] > 1e-4
