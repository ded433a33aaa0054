"""Batch-geometry invariance: one step's parameter gradient does not depend on how it is split.

A tiny Llama in float64 on CPU runs each micro-batch in the flat packed layout (one row, position
ids restarting per sequence: Hugging Face restricts attention to each sequence from them), then
``ops.token_logprobs`` and ``algorithm.loss`` with the step's global totals. The gradient must be
the same (max abs diff < 1e-10) for micro-batch sizes 1, 2 and 4, packed with padding, a classic
right-padded [B, L] batch, and data-parallel size 1 vs 2 (two gloo processes, summed gradients).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore.algorithms import config as C
from rlcore.algorithms.base import merge_metrics
from rlcore.interfaces import SequenceBatch
from rlcore.training.ops import token_logprobs
from rlcore.data.packing import MicroBatch, make_micro_batches, step_totals

LENGTHS = [5, 9, 3, 12, 7, 8, 4]
TOL = 1e-10


def build_model():
    from transformers import LlamaForCausalLM

    from rlcore.testing.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=64, hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1,
                         intermediate_size=128, max_positions=64)
    return LlamaForCausalLM(config).double().eval()  # eval: no dropout; gradients still flow


def build_batch(model) -> SequenceBatch:
    """Random sequences (2 prompt tokens each) with old/ref/gen logprobs near the model's own, so
    that ratios straddle the clip range and every loss term is active."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 64, (n,), generator=g) for n in LENGTHS]
    masks = [torch.cat([torch.zeros(2), torch.ones(n - 2)]) for n in LENGTHS]
    with torch.no_grad():
        current = [token_logprobs(model(input_ids=x[None]).logits[0], x) for x in ids]
    noise = lambda n, s: s * torch.randn(n, generator=g, dtype=torch.float64)  # noqa: E731
    adv = torch.randn(len(LENGTHS), generator=g, dtype=torch.float64)
    return SequenceBatch(
        input_ids=ids, loss_mask=masks,
        token_fields={
            "advantages": [torch.full((n,), float(a), dtype=torch.float64) for n, a in zip(LENGTHS, adv)],
            "old_logprobs": [lp + noise(lp.numel(), 0.3) for lp in current],
            "ref_logprobs": [lp + noise(lp.numel(), 0.2) for lp in current],
            "gen_logprobs": [lp + noise(lp.numel(), 0.5) for lp in current],
            # PPO's critic fields: old values near the "values" the value loss gets (the current
            # logprobs stand in for them there), so the value clip binds on some tokens
            "values": [lp + noise(lp.numel(), 0.3) for lp in current],
            "returns": [lp + noise(lp.numel(), 1.0) for lp in current],
        },
        seq_fields={"advantages": adv},
    )


ALGORITHMS = {
    "grpo_token_kl_tis": ("grpo", C.GRPOConfig(kl_coef=0.05, kl_estimator="k3", gen_is_cap=1.5, ratio_clip_c=3.0)),
    "grpo_sequence": ("grpo", C.GRPOConfig(loss_level="sequence", kl_coef=0.1, kl_estimator="k2")),
    "grpo_seq_tis": ("grpo", C.GRPOConfig(rollout_correction=C.RolloutCorrectionConfig(preset="seq_tis", cap=1.5))),
    "grpo_seq_mis": ("grpo", C.GRPOConfig(loss_level="sequence",
                                          rollout_correction=C.RolloutCorrectionConfig(preset="seq_mis", low=0.3, high=3.0))),
    "grpo_token_mis": ("grpo", C.GRPOConfig(rollout_correction=C.RolloutCorrectionConfig(preset="token_mis", low=0.6, high=1.6))),
    "grpo_icepop": ("grpo", C.GRPOConfig(rollout_correction=C.RolloutCorrectionConfig(preset="icepop", icepop_k=1.5))),
    "gspo": ("gspo", C.GSPOConfig(ratio_clip_min=0.1, ratio_clip_max=0.1)),
    "dr_grpo": ("dr_grpo", C.DrGRPOConfig(normalizer_length=16)),
    "dapo": ("dapo", C.DAPOConfig(kl_coef=0.02, kl_estimator="k1")),
    "rloo": ("rloo", C.RLOOConfig(loss_level="sequence")),
    "reinforce_pp": ("reinforce_pp", C.ReinforcePPConfig()),
    "sft": ("sft", C.SFTConfig()),
    "ppo": ("ppo", C.PPOConfig(kl_coef=0.05, ratio_clip_c=3.0)),
    "ppo_value_loss": ("value", 0.2),  # the critic's loss, the leaves standing for values
    "ppo_value_loss_unclipped": ("value", None),
}
# Through the whole model (the other losses share their reductions; they are checked on the
# logprob gradient below, which is what the model's backward consumes).
MODEL_ALGORITHMS = ["grpo_token_kl_tis", "gspo"]


def build_algorithm(key: str):
    from rlcore.plugins import get_plugin_manager

    name, cfg = ALGORITHMS[key]
    if name == "value":
        from rlcore.algorithms.value_loss import ValueLoss

        return ValueLoss(cfg)
    return get_plugin_manager().get("algorithm", name).build(cfg)


def packed_logprobs(model, mb: MicroBatch) -> torch.Tensor:
    out = model(input_ids=mb.input_ids_T[None], position_ids=mb.position_ids_T[None], use_cache=False)
    return token_logprobs(out.logits[0], mb.input_ids_T, mb.cu_seqlens, chunk_tokens=5)


def padded_logprobs(model, mb: MicroBatch) -> torch.Tensor:
    """The classic layout: sequences right-padded to [B, L] with an attention mask, then the valid
    positions gathered back into the micro-batch's flat order."""
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
    rows = torch.nn.utils.rnn.pad_sequence(list(torch.split(mb.input_ids_T[: sum(lengths)], lengths)), batch_first=True)
    attn = (torch.arange(rows.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
    logits = model(input_ids=rows, attention_mask=attn, use_cache=False).logits
    parts = [token_logprobs(logits[i, :n], rows[i, :n]) for i, n in enumerate(lengths)]
    return torch.nn.functional.pad(torch.cat(parts), (0, mb.num_padding))


def step_gradient(model, algorithm, micro_batches, totals, forward=packed_logprobs):
    """(flat parameter gradient, summed metrics) of one step over the given micro-batches."""
    model.zero_grad(set_to_none=True)
    metrics: dict[str, float] = {}
    for mb in micro_batches:
        loss, m = algorithm.loss(forward(model, mb), mb, totals)
        loss.backward()
        merge_metrics(metrics, m)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return torch.cat([g.reshape(-1) for g in grads]), metrics


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: threads only add overhead on shared cores
    model = build_model()
    yield model, build_batch(model)
    torch.set_num_threads(threads)


def _assert_same(a, b, what):
    (ga, ma), (gb, mb) = a, b
    diff = (ga - gb).abs().max().item()
    assert diff < TOL, f"{what}: max abs gradient difference {diff:.3e}"
    assert ga.abs().max() > 1e-6, "gradient is zero: the test would pass vacuously"
    assert ma.keys() == mb.keys()
    for k in ma:
        assert abs(ma[k] - mb[k]) < TOL, f"{what}: metric {k} {ma[k]} vs {mb[k]}"


@pytest.mark.parametrize("key", MODEL_ALGORITHMS)
def test_gradient_invariant_to_micro_batch_size_packing_and_padding(setup, key):
    model, batch = setup
    algorithm = build_algorithm(key)
    totals = step_totals(batch)
    reference = step_gradient(model, algorithm, make_micro_batches(batch, 0, pack=False, micro_batch_size=1), totals)
    for mbs in (2, 4):
        got = step_gradient(model, algorithm, make_micro_batches(batch, 0, pack=False, micro_batch_size=mbs), totals)
        _assert_same(reference, got, f"micro_batch_size {mbs} vs 1")
    packed = make_micro_batches(batch, 16, pad_to_multiple=6)
    assert any(mb.num_seqs > 1 for mb in packed) and any(mb.num_padding for mb in packed)
    _assert_same(reference, step_gradient(model, algorithm, packed, totals), "packed+padded vs unpacked")
    whole = make_micro_batches(batch, 0, pack=False, micro_batch_size=len(LENGTHS))
    _assert_same(reference, step_gradient(model, algorithm, whole, totals, padded_logprobs), "[B, L] padded vs unpacked")


def logprob_gradient(algorithm, batch, leaves, micro_batches, totals):
    """(d step loss / d per-sequence logprobs, summed metrics) for given micro-batches."""
    for leaf in leaves:
        leaf.grad = None
    metrics: dict[str, float] = {}
    for mb in micro_batches:
        parts = [leaves[i] for i in mb.seq_ids] + [torch.zeros(mb.num_padding, dtype=torch.float64)]
        loss, m = algorithm.loss(torch.cat(parts), mb, totals)
        if mb.seq_ids:  # an empty micro-batch has no leaf in its graph here (a model would)
            loss.backward()
        merge_metrics(metrics, m)
    return torch.cat([leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]), metrics


@pytest.mark.parametrize("key", list(ALGORITHMS))
def test_logprob_gradient_invariant_for_every_algorithm(setup, key):
    model, batch = setup
    algorithm = build_algorithm(key)
    totals = step_totals(batch)
    with torch.no_grad():
        current = [token_logprobs(model(input_ids=x[None]).logits[0], x) for x in batch.input_ids]
    leaves = [lp.clone().requires_grad_(True) for lp in current]
    run = lambda mbs: logprob_gradient(algorithm, batch, leaves, mbs, totals)  # noqa: E731
    reference = run(make_micro_batches(batch, 0, pack=False, micro_batch_size=1))
    layouts = {f"micro_batch_size {m}": make_micro_batches(batch, 0, pack=False, micro_batch_size=m) for m in (2, 4)}
    layouts["packed+padded"] = make_micro_batches(batch, 16, pad_to_multiple=6)
    for name, mbs in layouts.items():
        _assert_same(reference, run(mbs), f"{key}: {name} vs 1")
    dp = [run(make_micro_batches(batch, 16, dp_rank=r, dp_size=2, pad_to_multiple=4)) for r in range(2)]
    summed = (dp[0][0] + dp[1][0], merge_metrics(dict(dp[0][1]), dp[1][1]))
    _assert_same(reference, summed, f"{key}: dp 2 (summed) vs 1")


def test_packed_attention_is_per_sequence(setup):
    """Guard for the harness itself: packed logprobs equal each sequence run alone."""
    model, batch = setup
    (mb,) = make_micro_batches(batch, 64)
    with torch.no_grad():
        packed = packed_logprobs(model, mb)
        ids = [batch.input_ids[i] for i in mb.seq_ids]
        alone = torch.cat([token_logprobs(model(input_ids=x[None]).logits[0], x) for x in ids])
    assert (packed[: alone.numel()] - alone).abs().max() < TOL


# ---- data parallel: 2 gloo processes ---------------------------------------------------------
def _dp_worker(rank: int, world: int, rendezvous: str, out: str) -> None:
    import torch.distributed as dist

    # A file rendezvous: no free-port race with the other tests' processes.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    model = build_model()
    batch = build_batch(model)
    totals = step_totals(batch)
    results = {}
    for key in MODEL_ALGORITHMS:
        mbs = make_micro_batches(batch, 16, dp_rank=rank, dp_size=world, pad_to_multiple=4)
        grad, metrics = step_gradient(model, build_algorithm(key), mbs, totals)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        reduced = {}
        for op, names in ((dist.ReduceOp.SUM, [k for k in metrics if not k.endswith("_max")]),
                          (dist.ReduceOp.MAX, [k for k in metrics if k.endswith("_max")])):  # as merge_metric
            values = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64)
            dist.all_reduce(values, op=op)
            reduced.update(zip(names, values.tolist()))
        results[key] = (grad, reduced, [len(m.seq_ids) for m in mbs])
    if rank == 0:
        torch.save(results, out)
    dist.barrier()  # nobody tears gloo down while the other rank still talks to it
    dist.destroy_process_group()


def test_gradient_invariant_to_data_parallel_size(setup, tmp_path):
    model, batch = setup
    out = tmp_path / "dp2.pt"
    rendezvous = tmp_path / "rendezvous"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(rendezvous), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        logs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    results = torch.load(out)
    totals = step_totals(batch)
    for key in MODEL_ALGORITHMS:
        single = step_gradient(model, build_algorithm(key), make_micro_batches(batch, 16), totals)
        grad, metrics, _ = results[key]
        _assert_same(single, (grad, metrics), f"{key}: dp 2 vs 1")
    # rank 0's layout: the two ranks got equal micro-batch counts, one of them an empty one
    plans = [make_micro_batches(batch, 16, dp_rank=r, dp_size=2) for r in range(2)]
    assert len(plans[0]) == len(plans[1]) and any(not mb.seq_ids for p in plans for mb in p)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _dp_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    # Skip interpreter teardown: once in a few CI runs a gloo thread still joinable there aborted
    # the process ("terminate called without an active exception") after all its work was done.
    sys.stdout.flush()
    os._exit(0)
