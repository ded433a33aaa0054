"""The fsdp2 backend computes logits only on the rows a loss reads (``MicroBatch.logprob_rows_R``):
fp32 logprobs and gradients there equal the full-vocabulary-over-every-row computation's, and the
prompt rows get no logits at all."""

from __future__ import annotations

import attrs
import pytest
import torch

from rlcore.interfaces import SequenceBatch


def _batch() -> SequenceBatch:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 100, (n,), generator=g) for n in (9, 14, 5, 11)]
    masks = [torch.cat([torch.zeros(p), torch.ones(len(x) - p)]) for x, p in zip(ids, (4, 9, 2, 6))]
    return SequenceBatch(input_ids=ids, loss_mask=masks)


@pytest.fixture(scope="module")
def backend(single_process_group, tiny_model_dir):
    from rlcore.config.schema import PolicyConfig, RunConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig

    cfg = DTensorConfig()
    backend = FSDP2Backend(RunConfig(policy=PolicyConfig(model_name=str(tiny_model_dir), precision="float32"),
                                     sections={SECTION: cfg}), cfg, WorldInfo())
    yield backend
    backend.shutdown()


def _logprobs_and_grads(backend, mb):
    backend.model.zero_grad(set_to_none=True)
    logprobs_T = backend._forward_logprobs(mb)
    (logprobs_T * mb.loss_mask_T * torch.linspace(-1, 1, mb.num_tokens)).sum().backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in backend.model.named_parameters()}
    backend.model.zero_grad(set_to_none=True)
    return logprobs_T.detach(), grads


def test_selected_rows_equal_every_row_on_the_loss_tokens(backend):
    from rlcore.data.packing import make_micro_batches

    (mb,) = make_micro_batches(_batch(), max_tokens=64)
    needed = mb.loss_mask_T > 0
    assert mb.logprob_rows_R.tolist() == (torch.nonzero(needed).flatten() - 1).tolist()
    rows_seen = []
    hook = backend.model.lm_head.register_forward_hook(lambda module, args, out: rows_seen.append(out.shape[-2]))
    try:
        selected, selected_grads = _logprobs_and_grads(backend, mb)
        every_row, every_row_grads = _logprobs_and_grads(backend, attrs.evolve(mb, logprob_rows_R=None))
    finally:
        hook.remove()
    assert rows_seen == [int(needed.sum()), mb.num_tokens]  # the LM head ran on the loss rows only
    assert torch.equal(selected[~needed], torch.zeros(int((~needed).sum())))
    # The same rows through the same kernels, but a GEMM over another number of rows may block its sums
    # otherwise (BLAS, thread count): up to ~K * eps32 of each sum's magnitude, K = the hidden size (128)
    # for the logits and the rows (39) for the LM head's weight gradient. A wrong row differs by order 1.
    rounding = 128 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(selected[needed], every_row[needed], rtol=rounding, atol=rounding)
    for name, grad in every_row_grads.items():
        torch.testing.assert_close(selected_grads[name], grad, rtol=rounding, atol=rounding * float(grad.abs().max()),
                                   msg=lambda m: f"{name}: {m}")
