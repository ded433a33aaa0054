"""Weights & Biases and MLflow loggers; each imports its client only when enabled."""

from __future__ import annotations

from pathlib import Path


class WandbLogger:
    def __init__(self, config, run_dir: Path):
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("logger.wandb.enabled is true but wandb is not installed: pip install wandb") from exc
        self.wandb = wandb
        self.run = wandb.init(project=config.project, name=config.name, dir=str(run_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_rollouts(self, rows: list[list], step: int) -> None:
        """A few of the step's rollout traces as a ``wandb.Table``."""
        from rlcore.loggers.traces import TABLE_COLUMNS

        self.run.log({"rollouts": self.wandb.Table(columns=list(TABLE_COLUMNS), data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(self, config, run_dir: Path):
        try:
            import mlflow
        except ImportError as exc:
            raise RuntimeError("logger.mlflow.enabled is true but mlflow is not installed: pip install mlflow") from exc
        self.mlflow = mlflow
        mlflow.set_experiment(config.experiment)
        self.run = mlflow.start_run()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("/", "_"): float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()
