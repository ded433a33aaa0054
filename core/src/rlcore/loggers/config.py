"""Schemas of the built-in loggers' sections (``logger.<name>``). No heavy imports here."""

from __future__ import annotations

from attrs import field, frozen

from rlcore.config.structure import doc
from rlcore.config.traces import inside_log_dir


@frozen
class JsonlLoggerConfig:
    enabled: bool = field(default=True, metadata=doc("write metrics.jsonl, one record per step"))
    filename: str = field(default="metrics.jsonl", validator=inside_log_dir("logger.jsonl"),
                          metadata=doc("file name inside logger.log_dir (relative, no '.' or '..' parts, not one "
                                       "of the run's own files or directories)"))


@frozen
class TensorboardLoggerConfig:
    enabled: bool = field(default=False, metadata=doc("write TensorBoard event files"))


@frozen
class WandbLoggerConfig:
    enabled: bool = field(default=False, metadata=doc("log to Weights & Biases (needs wandb installed)"))
    project: str = field(default="rlcore", metadata=doc("project"))
    name: str | None = field(default=None, metadata=doc("run name"))


@frozen
class MlflowLoggerConfig:
    enabled: bool = field(default=False, metadata=doc("log to MLflow (needs mlflow installed)"))
    experiment: str = field(default="rlcore", metadata=doc("experiment name"))
