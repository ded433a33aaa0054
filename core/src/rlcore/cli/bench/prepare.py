"""The bench's run: the recipe with a random-init model of its shape and the bench's settings."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from rlcore.cli.bench.models import build_model, model_info


def bench_config(args):
    """The recipe with the bench's settings (a fresh run directory, no checkpoints or validation,
    responses to ``max_new_tokens``), its random-init model, and that model's size."""
    # Asked through NVML: torch.cuda.is_available() would otherwise create this process's CUDA context
    # before the run places its trainer and engine (and before an MPS client priority can be set).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    from rlcore.loading.loader import load_config

    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup}: the means need a step after warm-up")
    recipe = load_config(args.recipe, list(args.overrides))
    from rlcore.controller.verbosity import apply_verbosity

    apply_verbosity(recipe.logger.verbosity)  # before the model is built: transformers' "Writing model shards" bar
    out = bench_out_dir(args, create=False)
    model = build_model(recipe.policy.model_name, Path(args.workdir), args.shape, gpu=torch.cuda.is_available())
    bench = [f"policy.model_name={model}", f"policy.tokenizer_name={model}", f"train.max_num_steps={args.steps}",
             f"grpo.summary_window=[{args.warmup + 1},{args.steps}]", "train.val_period=0", "train.val_at_start=false",
             "checkpointing.enabled=false", f"logger.log_dir={out}", "logger.plot=false",
             "policy.generation.ignore_eos=true"]
    config = load_config(args.recipe, list(args.overrides) + bench)
    return config, model_info(model), out


def bench_out_dir(args, create: bool = True) -> Path:
    """``--out``, default ``runs/bench/<recipe>-<UTC time>``; refused when it holds anything already."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    out = Path(args.out or Path("runs") / "bench" / f"{Path(args.recipe).stem}-{stamp}")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out}: not empty; a bench writes a new run directory")
    if create:
        out.mkdir(parents=True, exist_ok=True)
    return out
