"""What a person sees as the run goes: a compact line table per step and a progress bar (the summary and the
curves at its end: :mod:`rlcore.controller.run_end`)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlcore.controller.heartbeat import doing, said

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
