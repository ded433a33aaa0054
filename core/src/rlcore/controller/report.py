"""What a person sees: a compact line table per step, a progress bar, the final summary, a plot."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

STEP_COLUMNS = [
    ("step", "step", "{:.0f}"),
    ("reward", "train/reward_mean", "{:.3f}"),
    ("val acc", "val/accuracy", "{:.3f}"),
    ("loss", "train/loss", "{:+.4f}"),
    ("total s", "timing/total", "{:.2f}"),
    ("gen", "timing/generation", "{:.2f}"),
    ("refit", "timing/refit", "{:.2f}"),
    ("lp", "timing/logprobs", "{:.2f}"),
    ("train", "timing/training", "{:.2f}"),
    ("reward s", "timing/reward", "{:.2f}"),
    ("tok/sample", "rollout/mean_response_tokens", "{:.1f}"),
    ("probe mean", "refit/probe_mean_abs_logprob_diff", "{:.1e}"),
    ("probe max", "refit/probe_max_abs_logprob_diff", "{:.1e}"),
]
# A critic's phases (ppo), after the logprobs as in the summary table; shown when the run has them.
CRITIC_COLUMNS = [("values", "timing/values", "{:.2f}"), ("critic", "timing/critic_train", "{:.2f}")]


def step_columns(record: dict) -> list[tuple[str, str, str]]:
    """The per-step table's columns for a run whose first record is ``record``."""
    if "timing/values" not in record:
        return STEP_COLUMNS
    at = [name for name, _, _ in STEP_COLUMNS].index("lp") + 1
    return [*STEP_COLUMNS[:at], *CRITIC_COLUMNS, *STEP_COLUMNS[at:]]


class Reporter:
    def __init__(self, total_steps: int, enabled: bool = True, console: Console | None = None):
        self.console = console or Console()
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
            console=self.console, transient=True,
        )
        self.task = self.progress.add_task("steps", total=total_steps)
        self._columns: list[tuple[str, str, str]] | None = None  # chosen at the first step's record

    def __enter__(self):
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def step(self, record: dict, completed: int) -> None:
        self.progress.update(self.task, completed=completed)
        if not self.enabled:
            return
        if self._columns is None:
            self._columns = step_columns(record)
            self.console.print(" ".join(f"{name:>10}" for name, _, _ in self._columns), style="bold", highlight=False, soft_wrap=True)
        cells = []
        for _, key, fmt in self._columns:
            value = record.get(key)
            cells.append(f"{fmt.format(value) if value is not None else '-':>10}")
        self.console.print(" ".join(cells), highlight=False, soft_wrap=True)


def summary_table(summary: dict, title: str) -> Table:
    """The NeMo-RL table row: Step, Train, Refit, Generation, Logprobs, Tokens/sample (seconds)."""
    table = Table(title=title)
    # A critic's phases (ppo) get columns of their own after Logprobs, as NeMo-RL's PPO table has them.
    critic = ["Values", "Critic"] if "timing/values" in summary else []
    # Short headers: the table must fit 80 columns (rich's width when output is not a terminal),
    # shorter still with the critic's two.
    headers = ("steps", "Step", "Train", "Refit", "Gen", "LP", *critic, "Rew", "Tok") if critic else \
        ("steps", "Step s", "Train", "Refit", "Gen", "Logprobs", "Reward", "Tok/sample")
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
    return table


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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
