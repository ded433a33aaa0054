"""Typed run configuration: the frozen attrs schemas of every section and where a run's files go; imports only rlcore.errors (loading a recipe into them is rlcore.loading's)."""

from rlcore.config.generation import ColocatedConfig, GenerationConfig, GenerationResources, RefitConfig
from rlcore.config.schema import RunConfig
from rlcore.config.structure import ConfigError, doc, structure, unstructure

__all__ = [
    "ColocatedConfig", "ConfigError", "GenerationConfig", "GenerationResources", "RefitConfig", "RunConfig",
    "doc", "structure", "unstructure",
]
