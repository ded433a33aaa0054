"""Packing plan, flat layout, unpacking, step totals and chunked token logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlcore.interfaces import SequenceBatch
from rlcore.training.ops import token_logprobs
from rlcore.data.packing import make_micro_batches, plan_micro_batches, step_totals, unpack


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 50, (n,), generator=g) for n in lengths]
    masks = [torch.cat([torch.zeros(n // 2), torch.ones(n - n // 2)]) for n in lengths]
    adv = torch.randn(len(lengths), generator=g)
    return SequenceBatch(
        input_ids=ids, loss_mask=masks,
        token_fields={"advantages": [torch.full((n,), float(a)) for n, a in zip(lengths, adv)],
                      "old_logprobs": [-torch.rand(n, generator=g) for n in lengths]},
        seq_fields={"rewards": torch.arange(len(lengths), dtype=torch.float32)},
    )


def _flatten(plan):
    return sorted(i for rank in plan for mb in rank for i in mb)


def test_plan_covers_every_sequence_once_within_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=500).tolist()
    for dp in (1, 2, 3):
        plan = plan_micro_batches(lengths, 128, dp)
        assert len(plan) == dp
        assert len({len(r) for r in plan}) == 1, "ranks must have equal micro-batch counts"
        assert _flatten(plan) == list(range(500))
        assert all(sum(lengths[i] for i in mb) <= 128 for r in plan for mb in r)


def test_plan_balances_ranks_by_tokens_and_pads_with_empty_micro_batches():
    plan = plan_micro_batches([10, 10, 10], 10, dp_size=2)
    assert [len(r) for r in plan] == [2, 2]
    assert sorted(len(mb) for r in plan for mb in r) == [0, 1, 1, 1]
    rng = np.random.default_rng(1)
    lengths = rng.integers(16, 512, size=2000)
    plan = plan_micro_batches(lengths.tolist(), 2048, dp_size=4)
    tokens = [sum(int(lengths[i]) for mb in r for i in mb) for r in plan]
    assert max(tokens) - min(tokens) <= 2048


def test_plan_is_tight_on_lognormal_lengths():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.0, 1.0, size=20000), 16, 4096).astype(int)
    plan = plan_micro_batches(lengths.tolist(), 8192)
    fill = lengths.sum() / (len(plan[0]) * 8192)
    assert fill >= 0.95, fill


def test_plan_rejects_too_long_sequence_naming_it():
    with pytest.raises(ValueError, match=r"sequence 2 has 300 tokens.*max_tokens=256"):
        plan_micro_batches([10, 20, 300, 5], 256)
    with pytest.raises(ValueError, match="sequence 1 has length 0"):
        plan_micro_batches([3, 0], 256)


def test_plan_unpacked_fixed_size():
    plan = plan_micro_batches([5] * 7, 0, dp_size=2, pack=False, micro_batch_size=2)
    assert plan == [[[0, 1], [2, 3]], [[4, 5], [6]]]
    with pytest.raises(ValueError, match="micro_batch_size"):
        plan_micro_batches([5], 10, pack=False)


def test_layout_positions_cu_seqlens_padding_and_fields():
    batch = _batch([3, 5, 4])
    (mb,) = make_micro_batches(batch, max_tokens=64, pad_to_multiple=8)
    assert mb.seq_ids == [0, 1, 2]
    assert mb.num_tokens == 16 and mb.num_padding == 4
    assert mb.cu_seqlens.tolist() == [0, 3, 8, 12] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 5
    assert mb.position_ids_T.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3]
    assert mb.seq_index_T.tolist() == [0] * 3 + [1] * 5 + [2] * 4 + [-1] * 4
    assert mb.input_ids_T[12:].tolist() == [0, 0, 0, 0]
    assert mb.loss_mask_T[mb.cu_seqlens[:-1].long()].tolist() == [0, 0, 0]
    assert mb.loss_mask_T[12:].sum() == 0
    for name in ("advantages", "old_logprobs"):
        parts = unpack(mb.token_fields[name], mb)
        for j, i in enumerate(mb.seq_ids):
            assert torch.equal(parts[j], batch.token_fields[name][i])
    assert torch.equal(mb.seq_fields["rewards"], batch.seq_fields["rewards"])
    parts = unpack(mb.input_ids_T, mb)
    assert all(torch.equal(p, batch.input_ids[i]) for p, i in zip(parts, mb.seq_ids))


def test_layout_on_all_ranks_covers_batch_and_empty_micro_batches_are_runnable():
    batch = _batch([7, 7, 7])
    mbs = [make_micro_batches(batch, max_tokens=7, dp_rank=r, dp_size=2, pad_to_multiple=4) for r in range(2)]
    assert len(mbs[0]) == len(mbs[1]) == 2
    assert sorted(i for r in mbs for mb in r for i in mb.seq_ids) == [0, 1, 2]
    empty = [mb for r in mbs for mb in r if not mb.seq_ids]
    assert len(empty) == 1
    e = empty[0]
    assert e.num_tokens == 4 and e.num_padding == 4 and e.cu_seqlens.tolist() == [0]
    assert e.loss_mask_T.sum() == 0 and e.token_fields["advantages"].shape == (4,)


def test_layout_rejects_mismatched_shapes():
    batch = _batch([3, 4])
    batch.loss_mask[1] = torch.ones(5)
    with pytest.raises(ValueError, match=r"loss_mask\[1\] has shape \(5,\)"):
        make_micro_batches(batch, 64)
    batch = _batch([3, 4])
    batch.token_fields["advantages"][0] = torch.ones(2)
    with pytest.raises(ValueError, match=r"token field 'advantages'\[0\]"):
        make_micro_batches(batch, 64)
    batch = _batch([3, 4])
    batch.seq_fields["rewards"] = torch.ones(3)
    with pytest.raises(ValueError, match="seq field 'rewards'"):
        make_micro_batches(batch, 64)


def test_step_totals_counts_and_all_masked_error():
    batch = _batch([3, 5, 4])
    batch.loss_mask[0] = torch.tensor([1.0, 0.0, 0.0])  # only the first token: not trainable
    totals = step_totals(batch)
    assert totals.num_valid_tokens == 3 + 2 and totals.num_valid_seqs == 2
    batch.loss_mask = [torch.zeros(n) for n in (3, 5, 4)]
    with pytest.raises(ValueError, match="all-zero loss_mask"):
        step_totals(batch)


@pytest.mark.parametrize(("temperature", "fused"), [(1.0, False), (0.7, False), (0.7, True)])
def test_token_logprobs_matches_log_softmax_and_its_gradient(temperature, fused):
    """``fused``: the chunk math compiled by torch.compile (the CUDA default), here on the CPU."""
    from rlcore.training import ops

    torch.manual_seed(0)
    T, V = 11, 17
    logits = torch.randn(T, V, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (T,))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)  # 2 sequences, then 2 padding tokens
    out = token_logprobs(logits, ids, cu, chunk_tokens=3, temperature=temperature, fused=fused)
    ref = torch.log_softmax(logits / temperature, -1)[torch.arange(T - 1), ids[1:]]
    ref = torch.cat([ref.new_zeros(1), ref])
    keep = torch.ones(T, dtype=torch.bool)
    keep[[0, 4, 9, 10]] = False
    ref = torch.where(keep, ref, torch.zeros(()))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    w = torch.randn(T, dtype=torch.float64)
    (g,) = torch.autograd.grad((out * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
    assert g[9:].abs().sum() == 0 and g[3].abs().sum() == 0  # rows predicting masked positions
    assert not ops._KERNELS.failed  # the compiled path ran (no silent fallback to eager)


def test_vocab_parallel_token_logprobs_equal_full_vocabulary_ones(tmp_path):
    """Two gloo ranks, each holding half the vocabulary: logprobs and each shard's gradient equal
    token_logprobs on the full logits (float64, eager and compiled chunk kernels); so do the
    selected form's on the rows it is given (0 on the other tokens)."""
    import ast
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker, out = Path(__file__).with_name("_vocab_parallel_worker.py"), tmp_path / "result.txt"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port), str(out)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    for fused, (value_err, grad_err) in ast.literal_eval(out.read_text()).items():
        assert value_err < 1e-12 and grad_err < 1e-12, (fused, value_err, grad_err)


def test_token_logprobs_float32_and_bf16_and_gradcheck():
    torch.manual_seed(1)
    logits = torch.randn(6, 9, dtype=torch.bfloat16)
    ids = torch.randint(0, 9, (6,))
    out = token_logprobs(logits, ids)
    assert out.dtype == torch.float32 and out[0] == 0
    ref = torch.log_softmax(logits.float(), -1)[torch.arange(5), ids[1:]]
    torch.testing.assert_close(out[1:], ref)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 4, (5,))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, t, chunk_tokens=2, temperature=0.5), (x,))
    with pytest.raises(ValueError, match=r"logits must be \[T, V\]"):
        token_logprobs(logits[None], ids)
    with pytest.raises(ValueError, match="input_ids has shape"):
        token_logprobs(logits, ids[:-1])
