"""One rank of the ``rlcore export`` round trip (launched by test_export.py).

Usage: python _export_worker.py RANK WORLD PORT MODEL_DIR OUT_DIR. Both ranks train one step and
save a run checkpoint (the run loop's CheckpointManager, the backend's own save) under each
layout: fsdp2 with 2 data-parallel ranks, Megatron TP=2, Megatron PP=2, Megatron TP=2 with LoRA
(adapters only in the checkpoint); each also writes the live
backend's Hugging Face export as the reference. Then rank 0 alone, its 2-rank group gone, runs
``rlcore export`` on each checkpoint and compares fp32 logits in ``transformers``; it writes
``OUT_DIR/results.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = {
    "fsdp2_dp2": {"dtensor_cfg": {"enabled": True}},
    "megatron_tp2": {"megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 2}},
    "megatron_pp2": {"megatron_cfg": {"enabled": True, "pipeline_model_parallel_size": 2}},
    # a checkpoint of the adapters alone: the export loads the base from policy.model_name, then them
    "megatron_tp2_lora": {"megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 2},
                          "lora": {"enabled": True, "rank": 4, "alpha": 8.0}},
}


def recipe(model_dir: str, log_dir: Path, backend: dict) -> dict:
    return {"policy": {"model_name": model_dir, "precision": "float32", "max_grad_norm": None,
                       "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
                       "sequence_packing": {"train_mb_tokens": 64, "logprob_mb_tokens": 64}, **backend},
            "algorithm": {"name": "sft"}, "cluster": {"cpu_workers": 2}, "logger": {"log_dir": str(log_dir)},
            "checkpointing": {"enabled": True}}


def batch():
    from rlcore.interfaces import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 100, (n,), generator=g) for n in (12, 17, 9, 20)]
    return SequenceBatch(input_ids=ids, loss_mask=[torch.cat([torch.zeros(3), torch.ones(len(t) - 3)]) for t in ids])


def save_layouts(rank: int, world: int, model_dir: str, out: Path) -> None:
    import yaml

    from rlcore.loading.loader import build_config, to_dict
    from rlcore.controller.checkpoint import CheckpointManager
    from rlcore.controller.engines import select_backend
    from rlcore.controller.run_dir import checkpoint_root, fingerprint
    from rlcore.interfaces import Placement, WorldInfo
    from rlcore.plugins import get_plugin_manager

    manager = get_plugin_manager()
    algorithm = manager.get("algorithm", "sft").build(None)
    for name, backend_section in LAYOUTS.items():
        log_dir = out / name
        config = build_config(recipe(model_dir, log_dir, backend_section))
        reg = select_backend(config, manager)
        placement = Placement(trainer_ranks=world, use_ray=True)
        backend = reg.build(config, config.section(reg.section), WorldInfo(rank, world, 0, "cpu", placement))
        backend.train(batch(), algorithm)
        if rank == 0:
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        identity = {"run_id": name, "log_dir": str(log_dir), "fingerprint": fingerprint(config)}
        # As in a run: the driver (rank 0 here) writes the loop state, every rank its backend part.
        ranks_ready = lambda path: (dist.barrier(), backend.save_checkpoint(path))  # noqa: E731
        if rank == 0:
            CheckpointManager(checkpoint_root(config), 1).save(1, ranks_ready, {"step": 1, "run": identity})
        else:
            ranks_ready(str(checkpoint_root(config) / f"step_000001.tmp.{name}" / "backend"))  # the run id names it
        backend.export_hf(str(log_dir / "reference"))
        backend.shutdown()
        dist.barrier()


def logits(model_dir: Path, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(t[None]).logits[0] for t in ids]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def export_and_compare(model_dir: str, out: Path) -> dict:
    from transformers import AutoTokenizer

    from rlcore.cli.commands import main as rlcore_main

    results: dict = {}
    ids = batch().input_ids
    base = logits(Path(model_dir), ids)
    for name in LAYOUTS:
        try:
            exported = out / name / "exported"
            code = rlcore_main(["export", str(out / name), str(exported)])
            ours, reference = logits(exported, ids), logits(out / name / "reference", ids)
            results[name] = {"exit_code": code, "logits_vs_reference": max_diff(ours, reference),
                             "logits_vs_base": max_diff(ours, base),
                             "tokenizer_roundtrip": AutoTokenizer.from_pretrained(exported).decode(
                                 AutoTokenizer.from_pretrained(exported)("12+7=")["input_ids"]),
                             "files": sorted(p.name for p in exported.iterdir())}
        except Exception:  # noqa: BLE001 - reported to the test, which fails naming the layout
            results[name] = "ERROR " + traceback.format_exc()
    return results


def main() -> None:
    rank, world, port, model_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
    from rlcore.controller.workers import init_distributed

    init_distributed(rank, world, int(port), "cpu")
    save_layouts(rank, world, model_dir, out)
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    dist.destroy_process_group()
    if rank == 0:
        os.environ.pop("MASTER_PORT", None)
        (out / "results.json").write_text(json.dumps(export_and_compare(model_dir, out), indent=2))


if __name__ == "__main__":
    main()
