"""What every run leaves when it ends, whatever its loop: the final model, a checkpoint of the
last step, and one block saying where its outputs are; and what the GRPO run shows of its steps at
the end: the summary table (:func:`summary_table`) and the curves (:func:`plot_curves`).

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

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from rlcore.config.run_paths import write_file

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

    from rlcore.config.run_paths import inside

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


def summary_table(summary: dict, algorithm: str) -> Group:
    """The NeMo-RL table row: Step, Train, Refit, Generation, Logprobs, Tokens/sample (seconds),
    titled with the run's ``algorithm``; then a line with the held-out metrics' first and last values."""
    title = f"{algorithm} summary: mean seconds per step, steps {summary.get('window_first', '?')}-{summary.get('window_last', '?')}"
    table = Table(title=title)
    # A critic's phases (ppo) get columns of their own after Logprobs, as NeMo-RL's PPO table has them.
    critic = ["Values", "Critic"] if "timing/values" in summary else []
    # Short headers: the table must fit 80 columns (rich's width when output is not a terminal),
    # shorter still with the critic's two. "Scoring"/"Score" is the environment's time to compute
    # rewards, not a reward.
    headers = ("steps", "Step", "Train", "Refit", "Gen", "LP", *critic, "Score", "Tok") if critic else \
        ("steps", "Step", "Train", "Refit", "Gen", "Logprobs", "Scoring", "Tok/sample")
    for column in headers:
        table.add_column(column, justify="right")

    def cell(key, fmt="{:.2f}"):
        return fmt.format(summary[key]) if key in summary else "-"

    critic_cells = [cell("timing/values"), cell("timing/critic_train")] if critic else []
    table.add_row(
        f"{summary.get('window_first', '?')}-{summary.get('window_last', '?')}",
        cell("timing/total"), cell("timing/training"), cell("timing/refit"), cell("timing/generation"),
        cell("timing/logprobs"), *critic_cells, cell("timing/reward"), cell("rollout/mean_response_tokens", "{:.1f}"),
    )
    line = held_out_line(summary)
    return Group(table, Text(line)) if line else Group(table)


def change(first: float | None, last: float | None) -> str:
    """``0.383 -> 0.758 (+0.375)``: a metric's first and last values, rounded to what they can show."""
    if first is None or last is None:
        return f"{'-' if first is None else f'{first:.3f}'} -> {'-' if last is None else f'{last:.3f}'}"
    return f"{first:.3f} -> {last:.3f} ({last - first:+.3f})"


def held_out_line(summary: dict) -> str:
    """``held-out accuracy 0.383 -> 0.758 (+0.375); reverse_kl ...``: each ``val/<name>_first``/``_last`` pair."""
    names = sorted({k[len("val/"):-len("_first")] for k in summary if k.startswith("val/") and k.endswith("_first")})
    parts = [f"{name} {change(summary.get(f'val/{name}_first'), summary.get(f'val/{name}_last'))}" for name in names
             if summary.get(f"val/{name}_first") is not None]
    return "held-out " + "; ".join(parts) if parts else ""


def plot_curves(records: list[dict], path: Path) -> Path | None:
    """Reward and held-out accuracy against step, as a PNG (None if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records if "train/reward_mean" in r]
    ax.plot(steps, [r["train/reward_mean"] for r in records if "train/reward_mean" in r], label="train reward (mean)")
    val = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    if val:
        ax.plot([s for s, _ in val], [a for _, a in val], marker="o", label="held-out accuracy")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return write_file(path, png.getvalue(), "the run's curves")
