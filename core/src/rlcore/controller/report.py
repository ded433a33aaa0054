"""What a person sees: a compact line table per step, a progress bar, the final summary, a plot."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from rlcore.controller.heartbeat import doing, said
from rlcore.config.run_paths import write_file

STEP_COLUMNS = [
    ("step", "step", "{:.0f}"),
    ("reward", "train/reward_mean", "{:.3f}"),
    ("val acc", "val/accuracy", "{:.3f}"),
    ("loss", "train/loss", "{:+.4f}"),
    ("total s", "timing/total", "{:.2f}"),
    ("gen", "timing/generation", "{:.2f}"),
    ("refit", "timing/refit", "{:.2f}"),
    ("logprobs", "timing/logprobs", "{:.2f}"),
    ("train", "timing/training", "{:.2f}"),
    ("scoring", "timing/reward", "{:.2f}"),
    ("tok/sample", "rollout/mean_response_tokens", "{:.1f}"),
    ("probe mean", "refit/probe_mean_abs_logprob_diff", "{:.1e}"),
    ("probe max", "refit/probe_max_abs_logprob_diff", "{:.1e}"),
]
# Printed once under the header: what the terse columns hold.
STEP_LEGEND = ("reward: mean train reward; val acc: held-out greedy accuracy; total s .. scoring: seconds in each phase "
               "(gen: generation, logprobs: old/reference logprob passes, scoring: the environment's reward); "
               "tok/sample: mean response tokens; probe mean/max: |generator - trainer| token logprob after the refit")

# A critic's phases (ppo), after the logprobs as in the summary table; shown when the run has them.
CRITIC_COLUMNS = [("values", "timing/values", "{:.2f}"), ("critic", "timing/critic_train", "{:.2f}")]


def step_columns(record: dict) -> list[tuple[str, str, str]]:
    """The per-step table's columns for a run whose first record is ``record``."""
    if "timing/values" not in record:
        return STEP_COLUMNS
    at = [name for name, _, _ in STEP_COLUMNS].index("logprobs") + 1
    return [*STEP_COLUMNS[:at], *CRITIC_COLUMNS, *STEP_COLUMNS[at:]]


class Reporter:
    def __init__(self, total_steps: int, enabled: bool = True, console: Console | None = None, label: str = "steps"):
        self.console = console or Console()
        self.enabled = enabled
        self.progress = Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
            console=self.console, transient=True,
        )
        self.task = self.progress.add_task("steps", total=total_steps)
        self._columns: list[tuple[str, str, str]] | None = None  # chosen at the first step's record
        self._at_start: dict | None = None  # the held-out metrics before the first step (train.val_at_start)

    def __enter__(self):
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def start(self, record: dict) -> None:
        """The step-0 record (held-out metrics before training): the table's first row, so the starting
        accuracy is on screen from the start, not only in the summary. Printed with the header, whose
        columns the first step's record decides."""
        self._at_start = record

    def step(self, record: dict, completed: int) -> None:
        self.progress.update(self.task, completed=completed)
        if not self.enabled:
            return
        if self._columns is None:
            self._columns = step_columns(record)
            self.console.print(" ".join(f"{name:>10}" for name, _, _ in self._columns), style="bold", highlight=False, soft_wrap=True)
            legend = STEP_LEGEND + ("; values, critic: the critic's passes (ppo)" if self._columns is not STEP_COLUMNS else "")
            self.console.print(legend, style="dim", highlight=False, soft_wrap=True)
            if self._at_start is not None:
                self._row(self._at_start)
        self._row(record)
        said()
        total = self.progress.tasks[0].total
        doing(f"step {completed + 1} of {total:.0f}" if completed < total else "ending the run (final model, summary)")

    def _row(self, record: dict) -> None:
        cells = []
        for _, key, fmt in self._columns:
            value = record.get(key)
            cells.append(f"{fmt.format(value) if value is not None else '-':>10}")
        self.console.print(" ".join(cells), highlight=False, soft_wrap=True)


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
