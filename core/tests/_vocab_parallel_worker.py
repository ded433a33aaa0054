"""One gloo rank of test_packing's vocab-parallel logprob check: python _vocab_parallel_worker.py RANK WORLD PORT OUT."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from rlcore.training.ops import token_logprobs, vocab_parallel_selected_token_logprobs, vocab_parallel_token_logprobs


def main(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same full logits on every rank
    T, V = 13, 10
    full = torch.randn(T, V, dtype=torch.float64)
    ids = torch.randint(0, V, (T,))
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    w = torch.randn(T, dtype=torch.float64)
    width = V // world
    results = {}
    for fused in (False, True):
        shard = full[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
        got = vocab_parallel_token_logprobs(shard, ids, cu, group=dist.group.WORLD, vocab_start=rank * width,
                                            chunk_tokens=4, temperature=0.8, fused=fused)
        (grad,) = torch.autograd.grad((got * w).sum(), shard)
        ref_logits = full.clone().requires_grad_(True)
        ref = token_logprobs(ref_logits, ids, cu, chunk_tokens=5, temperature=0.8, fused=False)
        (ref_grad,) = torch.autograd.grad((ref * w).sum(), ref_logits)
        results[fused] = (float((got - ref).abs().max()), float((grad - ref_grad[:, rank * width:(rank + 1) * width]).abs().max()))
        if fused:  # the selected form runs the same chunk kernels: checked eagerly (compiling again costs seconds)
            continue
        # The selected form: the logits of some rows only (rows 0-3 and 7-9 predict tokens of both sequences).
        rows = torch.tensor([0, 1, 2, 3, 7, 8, 9])
        rows_shard = full[rows, rank * width:(rank + 1) * width].clone().requires_grad_(True)
        picked = vocab_parallel_selected_token_logprobs(rows_shard, ids, rows, group=dist.group.WORLD, vocab_start=rank * width,
                                                        chunk_tokens=3, temperature=0.8, fused=fused)
        (rows_grad,) = torch.autograd.grad((picked * w).sum(), rows_shard)
        kept = torch.zeros(T, dtype=torch.bool).index_fill(0, rows + 1, True)
        results[f"selected, fused={fused}"] = (
            max(float((picked - ref)[kept].abs().max()), float(picked[~kept].abs().max())),
            float((rows_grad - ref_grad[rows, rank * width:(rank + 1) * width]).abs().max()))
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
