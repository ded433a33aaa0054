"""TensorBoard scalars through torch.utils.tensorboard (needs the tensorboard package)."""

from __future__ import annotations

from pathlib import Path

from rlcore.config.run_paths import inside


class TensorboardLogger:
    def __init__(self, config, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer_cls = SummaryWriter
        self.log_dir = str(inside(run_dir, "tensorboard", "logger.tensorboard.enabled"))
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def log_rollouts(self, rows: list[list], step: int) -> None:
        """A few of the step's rollout traces as a Markdown table under the Text tab."""
        from rlcore.loggers.traces import TABLE_COLUMNS

        def cell(value) -> str:
            return str(value).replace("|", "\\|").replace("\n", "⏎ ")

        lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text("rollouts", "\n".join(lines), step)

    def resume_at(self, step: int, records: list[dict] | None = None) -> None:
        """Events of the steps after ``step`` (the checkpoint resumed from) are redone: TensorBoard
        drops the earlier copies when it reads the directory. (``records``: the JSONL logger's.)"""
        self.writer.close()
        self.writer = self._writer_cls(log_dir=self.log_dir, purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()
