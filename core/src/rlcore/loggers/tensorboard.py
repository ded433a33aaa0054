"""TensorBoard scalars through torch.utils.tensorboard (needs the tensorboard package)."""

from __future__ import annotations

from pathlib import Path


class TensorboardLogger:
    def __init__(self, config, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
