"""One rank of the 2-rank test, started by torchrun: old logprobs, one GRPO step, the weights after.

    torchrun --standalone --nproc-per-node 2 ddp_two_rank_worker.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_common import build, grpo, make_batch, run_config
from rlcore.interfaces import WorldInfo

if __name__ == "__main__":
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = build(run_config(model_dir), WorldInfo(rank=rank, world_size=world_size, local_rank=int(os.environ["LOCAL_RANK"])))
    batch = make_batch()
    old = backend.logprobs(batch)
    assert (old is None) == (rank != 0), "rank 0 returns every sequence's logprobs, the others None"
    shared = [old]
    dist.broadcast_object_list(shared, src=0)
    batch.token_fields["old_logprobs"] = shared[0]
    metrics = backend.train(batch, grpo())
    if rank == 0:
        torch.save({name: p.detach().clone() for name, p in backend.model.named_parameters()}, f"{out_dir}/params.pt")
        Path(out_dir, "metrics.json").write_text(json.dumps(metrics))
    # Every rank holds the same weights after the step.
    flat = torch.cat([p.detach().reshape(-1) for p in backend.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "the ranks' weights diverged"
    backend.shutdown()
    dist.destroy_process_group()
