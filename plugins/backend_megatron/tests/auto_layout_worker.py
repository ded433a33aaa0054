"""One rank of the ``layout: auto`` check (launched by test_auto_layout.py for 2, 4 and 8 ranks).

Usage: python auto_layout_worker.py RANK WORLD PORT MODELS_JSON OUT_DIR. For each case the recipe's
``policy.megatron_cfg`` says ``layout: auto`` (some also set a size, which must be kept); the backend is
built through the recipe loader (so the section knows which keys it set), takes the planner's layout,
checks it against Megatron's groups and trains one step, which rank 0 compares with one plain PyTorch
AdamW step of the same model on the same batch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import SumNLL, exported, make_batch, record, reference_step  # noqa: E402

CASES = {"dense": ("llama", {}), "moe": ("qwen3_moe", {}), "moe_tp2_ep2": ("qwen3_moe", {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2})}


def run_config(path: str, keys: dict):
    from rlcore import build_config

    return build_config({
        "policy": {"model_name": path, "precision": "float32", "sequence_packing": {"train_mb_tokens": 64, "logprob_mb_tokens": 64},
                   "dtensor_cfg": {"enabled": False},
                   "megatron_cfg": {"enabled": True, "layout": "auto", **keys,
                                    "optimizer": {"lr": 1e-3, "weight_decay": 0.01, "adam_eps": 1e-6}}},
        "train": {"num_prompts_per_step": 4}, "grpo": {"num_generations_per_prompt": 4},
    })


def check(path: str, keys: dict) -> dict:
    from megatron.core import parallel_state as mpu
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import build_backend

    run = run_config(path, keys)
    backend = build_backend(run, run.section("policy.megatron_cfg"), WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size()))
    cfg = backend.cfg
    groups = [mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
              mpu.get_context_parallel_world_size(), mpu.get_expert_model_parallel_world_size(), mpu.get_data_parallel_world_size()]
    batch = make_batch(7, n=16)
    metrics = backend.train(batch, SumNLL())
    weights = exported(backend)
    out = {"tp": cfg.tensor_model_parallel_size, "pp": cfg.pipeline_model_parallel_size, "cp": cfg.context_parallel_size,
           "ep": cfg.expert_model_parallel_size, "etp": cfg.etp, "sp": cfg.sequence_parallel, "recompute": str(cfg.recompute),
           "groups": groups}
    if dist.get_rank() == 0:
        ref_loss, _, ref_weights = reference_step(path, batch, run, cfg)
        out["loss_diff"] = abs(metrics["loss"] - ref_loss)
        out["weight_diff"] = max(float((weights[k] - ref_weights[k]).abs().max()) for k in ref_weights)
    return out


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    models, tmp = json.loads(sys.argv[4]), Path(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    out: dict = {}
    for name, (arch, keys) in CASES.items():
        record(out, name, lambda a=arch, k=keys: check(models[a], k), spread=True)
    (tmp / f"rank_{rank}.json").write_text(json.dumps(out, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
