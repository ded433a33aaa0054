"""Typed run configuration: frozen attrs schemas, YAML recipes and dotted overrides."""

from rlcore.config.generation import ColocatedConfig, GenerationConfig, GenerationResources, RefitConfig
from rlcore.config.loader import apply_overrides, build_config, load_config, to_dict
from rlcore.config.schema import RunConfig
from rlcore.config.structure import ConfigError, doc, structure, unstructure

__all__ = [
    "ColocatedConfig", "ConfigError", "GenerationConfig", "GenerationResources", "RefitConfig", "RunConfig",
    "apply_overrides", "build_config", "doc", "load_config", "structure", "to_dict", "unstructure",
]
