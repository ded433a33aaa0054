"""What every run leaves when it ends, whatever its loop: the final model, a checkpoint of the
last step, and one block saying where its outputs are.

- ``<logger.log_dir>/model``: the policy in Hugging Face format (safetensors, ``config.json``,
  tokenizer), written by the backend's own ``export_hf`` on its ranks, as TRL's and verl's
  trainers save at the end of training. ``rlcore eval <log_dir>/model RECIPE`` reads it as it is.
  It is written beside its place and renamed there when complete (:func:`write_model`): a full
  disk leaves no empty or partial ``model/`` and is one error naming the space needed and free.
- With ``checkpointing.enabled``, a checkpoint of the last step when ``save_period`` did not fall
  on it (a 12-step run with ``save_period: 5`` otherwise keeps step 10 only).

A run a signal stopped (SIGTERM, Ctrl-C) writes its checkpoint in the loop; it writes the model
here only when checkpointing is off, so that what it trained is kept either way.

Each loop (:mod:`rlcore.controller.loop`, :mod:`rlcore.controller.offline`) calls these from one
line, so they carry over whatever shape the loops take.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL_DIR = "model"


def save_final_checkpoint(loop: Any) -> Path | None:
    """A checkpoint of ``loop.step`` unless one was just written (``loop.saved_step``) or checkpointing is off."""
    if loop.ckpt is None or loop.step <= 0 or loop.saved_step == loop.step:
        return None
    loop.save()
    return loop.ckpt.latest()


def save_final_model(loop: Any, trainer: Any, config: Any, run_dir: str | Path, tokenizer: Any = None) -> Path | None:
    """The final checkpoint (:func:`save_final_checkpoint`), then the policy as a Hugging Face model
    in ``run_dir/model`` with ``tokenizer`` (else the run's, loaded from ``policy.tokenizer_name``
    or the model directory). Returns the model directory, or None when a signal stopped the run
    and its checkpoint holds the model."""
    stopped = loop.stop_signal is not None
    if not stopped:
        save_final_checkpoint(loop)
    if stopped and loop.ckpt is not None:
        return None
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.policy.tokenizer_name or config.policy.model_name)

    def write(path: Path) -> None:
        trainer.run_on_ranks("rlcore.controller.offline:export_hf_on_rank", str(path), what="export_hf")
        tokenizer.save_pretrained(str(path))

    return write_model(run_dir, config, write)


def write_model(run_dir: str | Path, config: Any, write: Callable[[Path], None]) -> Path:
    """``write(path)`` writes the final model into a new directory, which then replaces
    ``run_dir/model`` (:func:`rlcore.config.run_paths.replace_dir`: a failed write, a full disk, keeps what
    was there). The exported model is in the loaded checkpoint's dtype: its weights' size on disk
    is what the message of a full disk says it needs."""
    from rlcore.config.run_paths import inside, replace_dir

    out = inside(run_dir, MODEL_DIR)
    model = Path(config.policy.model_name)
    needed = sum(p.stat().st_size for p in model.glob("*.safetensors")) if model.is_dir() else 0
    return replace_dir(out, write, "the final model", needed)


def write_summary(run_dir: str | Path, summary: dict) -> Path:
    """``run_dir/summary.json``, whole or not at all (a full disk: one error naming it, the earlier one kept)."""
    import json

    from rlcore.config.run_paths import inside, write_file

    return write_file(inside(run_dir, "summary.json"), json.dumps(summary, indent=2), "the run's summary")


def outputs(run_dir: str | Path, config: Any) -> list[tuple[str, Path]]:
    """What the run in ``run_dir`` left, as (what, where), for the files that exist."""
    from rlcore.controller.checkpoint import CheckpointManager
    from rlcore.controller.run_dir import checkpoint_root
    from rlcore.loggers.traces import trace_path

    run_dir = Path(run_dir)
    found = [("model (Hugging Face)", run_dir / MODEL_DIR), ("metrics", run_dir / "metrics.jsonl"),
             ("summary", run_dir / "summary.json"), ("curves", run_dir / "curves.png"),
             ("rollout traces", trace_path(run_dir, config.logger.rollouts)), ("TensorBoard", run_dir / "tensorboard")]
    latest = CheckpointManager(checkpoint_root(config), keep_last_k=1).latest()
    if latest is not None:
        found.insert(1, ("checkpoint", latest))
    return [(what, path) for what, path in found if path.exists()]


def print_outputs(run_dir: str | Path, config: Any, console: Any = None) -> None:
    """One block at the end of a run: where each of its outputs is, and what to do with the model."""
    listed = outputs(run_dir, config)
    if not listed:
        return
    width = max(len(what) for what, _ in listed)
    lines = [f"outputs of this run in {run_dir}:"] + [f"  {what:<{width}}  {path}" for what, path in listed]
    if any(path.name == MODEL_DIR for _, path in listed):
        lines.append(f"  evaluate it: rlcore eval {Path(run_dir) / MODEL_DIR} RECIPE")
    if any(what == "rollout traces" for what, _ in listed):
        lines.append(f"  read the rollouts: rlcore rollouts {run_dir} --worst")
    text = "\n".join(lines)
    if console is not None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)
    else:
        print(text, flush=True)
