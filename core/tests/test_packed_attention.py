"""rlcore.training.attention: packed causal attention equals per-sequence causal attention."""

from __future__ import annotations

import pytest
import torch

from rlcore.training.attention import attention_cu_seqlens, packed_causal_attention, sdpa


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


def _lower_right_reference(q_THD, k_TGD, v_TGD, q_bounds, k_bounds, scale):
    outs = []
    for qa, qb, ka, kb in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:]):
        q, k, v = q_THD[qa:qb].transpose(0, 1), k_TGD[ka:kb].transpose(0, 1), v_TGD[ka:kb].transpose(0, 1)
        groups = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        scores = (q @ k.transpose(-1, -2)) * scale
        # query j sees keys up to (Lk - Lq) + j: the queries are the last Lq positions of the keys
        positions_k, positions_q = (torch.arange(n, device=q.device) for n in (kb - ka, qb - qa))
        seen = positions_k[None, :] <= (kb - ka) - (qb - qa) + positions_q[:, None]
        outs.append((scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


def _lower_right_case(device, dtype):
    torch.manual_seed(2)
    q_lengths, k_lengths = [8, 8, 5, 12], [8, 24, 20, 12]  # equal, longer keys (CP chunks), one plain
    q = torch.randn(sum(q_lengths), 4, 64, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(sum(k_lengths), 2, 64, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(sum(k_lengths), 2, 64, dtype=dtype, device=device, requires_grad=True)
    cu_q = torch.tensor([0, *torch.tensor(q_lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    got = packed_causal_attention(q, k, v, cu_q, max(q_lengths), scale=0.125, cu_seqlens_k=cu_k, max_len_k=max(k_lengths))
    want = _lower_right_reference(q.double(), k.double(), v.double(), cu_q.tolist(), cu_k.tolist(), 0.125)
    return q, k, got, want, q_lengths, k_lengths


def test_separate_key_segments_use_a_bottom_right_causal_mask():
    q, k, got, want, q_lengths, k_lengths = _lower_right_case("cpu", torch.float64)
    assert float((got - want).detach().abs().max()) < 1e-10
    weights = torch.randn_like(want)
    grads = torch.autograd.grad((got * weights).sum(), (q, k), retain_graph=True)
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k), retain_graph=True)
    assert max(float((g - w).abs().max()) for g, w in zip(grads, want_grads)) < 1e-10
    # The second segment's first query sees the first 17 of its 24 keys and no later one.
    grad_k, = torch.autograd.grad(got[q_lengths[0]].sum(), k)
    start = k_lengths[0]
    assert float(grad_k[start : start + 17].abs().sum()) > 0 and float(grad_k[start + 17 :].abs().max()) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen needs CUDA")
def test_varlen_kernel_aligns_the_causal_mask_bottom_right():
    _, _, got, want, _, _ = _lower_right_case("cuda", torch.bfloat16)
    assert float((got.double() - want).abs().max()) < 2e-2
