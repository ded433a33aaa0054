"""rlcore.attention: packed causal attention equals per-sequence causal attention."""

from __future__ import annotations

import pytest
import torch

from rlcore.attention import attention_cu_seqlens, packed_causal_attention, sdpa


def _reference(q_THD, k_TGD, v_TGD, bounds, scale):
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[a:b].transpose(0, 1)[None] for x in (q_THD, k_TGD, v_TGD))
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) * scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append((probs @ v)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("lengths", [[30, 28, 31], [3, 90, 7], [50]], ids=["similar-padded-rows", "skewed-per-sequence", "one"])
def test_packed_attention_matches_per_sequence_reference(lengths):
    torch.manual_seed(0)
    pad = 5
    total = sum(lengths) + pad
    q = torch.randn(total, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, 2, 16, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_all, max_len = attention_cu_seqlens(cu, total, "cpu")
    assert cu_all.tolist()[-1] == total and max_len == max(lengths + [pad])
    got = packed_causal_attention(q, k, v, cu_all, max_len, scale=0.25)
    want = _reference(q, k, v, cu_all.tolist(), 0.25)
    assert got.shape == (total, 4, 16)
    assert float((got - want).detach().abs().max()) < 1e-10
    # Gradients flow to every token, and the first sequence never sees the others.
    grad_q, = torch.autograd.grad(got[: lengths[0]].sum(), q)
    assert float(grad_q[lengths[0]:].abs().max()) == 0.0


def test_sdpa_wrapper_sets_gqa_and_matches_functional():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(sdpa(q, k, v, is_causal=True), want)
