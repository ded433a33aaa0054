"""Packed attention on CPU: both strategies (padded rows, one call per sequence) equal causal
attention run on each sequence alone, in values and gradients; trailing padding stays finite."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from rlcore.training.attention import padded_rows_attention
from rlcore_fsdp2.attention import attention_cu_seqlens, varlen_attention_forward


def _inputs(lengths, pad, heads=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths) + pad
    q = torch.randn(1, heads, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, total


def _alone(q, k, v, lengths):
    """Each real sequence on its own: [L, H, D] pieces, concatenated."""
    out, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True, enable_gqa=True)
        out.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("lengths, pad", [([5, 7, 6, 7], 3), ([40, 3, 2], 0), ([9], 4), ([1, 1, 8], 2)])
def test_packed_attention_equals_each_sequence_alone(lengths, pad):
    q, k, v, cu, total = _inputs(lengths, pad)
    acu, max_len = attention_cu_seqlens(cu, total, "cpu")
    got, _ = varlen_attention_forward(None, q, k, v, None, cu_seq_lens_q=acu, max_length_q=max_len)
    real = sum(lengths)
    assert got.shape == (1, total, 4, 16) and torch.isfinite(got).all()
    want = _alone(q, k, v, lengths)
    torch.testing.assert_close(got[0, :real], want)
    grads = torch.autograd.grad(got[0, :real].square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)


def test_padded_rows_strategy_directly():
    lengths = [6, 2, 5]
    q, k, v, cu, total = _inputs(lengths, 0)
    sdpa = functools.partial(F.scaled_dot_product_attention, is_causal=True, enable_gqa=True)
    out = padded_rows_attention(sdpa, q, k, v, cu.tolist(), lengths)  # [1, H, T, D]
    torch.testing.assert_close(out[0].transpose(0, 1), _alone(q, k, v, lengths))


def test_unpacked_call_is_plain_causal_attention():
    q, k, v, _, _ = _inputs([6], 0)
    got, _ = varlen_attention_forward(None, q, k, v, None)
    torch.testing.assert_close(got[0], _alone(q, k, v, [6]))
