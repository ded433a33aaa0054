"""Schemas of the built-in loggers' sections (``logger.<name>``). No heavy imports here."""

from __future__ import annotations

from pathlib import PurePosixPath

from attrs import field, frozen

from rlcore.config.structure import ConfigError, doc


def _inside_log_dir(instance, attribute, value: str) -> None:
    """A plain relative path with no ``..``: the file stays inside logger.log_dir, under its lock."""
    path = PurePosixPath(value)
    if not value or path.is_absolute() or ".." in path.parts or "\\" in value or value.endswith("/"):
        raise ConfigError(f"logger.jsonl.{attribute.name}", f"{value!r} must be a file name inside logger.log_dir "
                          "(relative, no '..'); to write elsewhere set logger.log_dir")


@frozen
class JsonlLoggerConfig:
    enabled: bool = field(default=True, metadata=doc("write metrics.jsonl, one record per step"))
    filename: str = field(default="metrics.jsonl", validator=_inside_log_dir,
                          metadata=doc("file name inside logger.log_dir (relative, no '..')"))


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
