"""The public runtime: what plugins, examples and benchmarks may use of how rlcore runs things.

``rlcore.controller``, ``rlcore.loading``, ``rlcore.planning`` and ``rlcore.cli`` are the core's own
machinery and change without notice; this module is the stable face of the parts of them that
plugin code needs:

- processes: :func:`init_distributed` (one rank's ``torch.distributed`` group, the device bound),
  :func:`start_local_ray` (a loopback-only Ray instance that ends with its driver),
  :func:`start_reaper` (a small process that ends a driver's descendants once the driver has died);
- worker pools: :class:`LocalTrainer` (a backend's ranks in this process) and
  :class:`RayTrainerGroup` (one Ray actor per rank), both :class:`~rlcore.interfaces.TrainerHandle`;
  :func:`plan_placement` (where trainer ranks and generator go, from the run's config);
- refit and data helpers: :class:`StreamTransport` (weights streamed chunk by chunk into a
  generator), :func:`sampling_params`, :class:`Trajectory`, :func:`to_sequence_batch`;
- checkpoints and checks: :class:`CheckpointManager`, :func:`check_prompt_lengths`, :func:`check_rows` and
  :func:`text_problem` (a data file's rows bounded and its text checked before a library parses it);
- timing: :class:`StepTimer`, :func:`summarize` (the step-time means ``summary.json`` reports);
- configs and checkpoints as files: :func:`to_dict` (a resolved config as plain data),
  :func:`export_checkpoint` (a run's checkpoint to a Hugging Face model directory);
- ``layout: auto``: :func:`choose_layout` and :func:`describe_layout` (the planner's fastest fitting
  layout of a backend section for a number of ranks, and its one-line description).

:data:`PUBLIC_MODULES` lists every ``rlcore`` module that plugins and examples may import (a test
checks theirs); everything else in ``rlcore`` is internal.
"""

from __future__ import annotations

from rlcore.cli.export import export_checkpoint
from rlcore.controller.transport import StreamTransport
from rlcore.controller.checkpoint import CheckpointManager
from rlcore.controller.placement import plan_placement
from rlcore.controller.preflight import check_prompt_lengths
from rlcore.controller.ray_local import start_local_ray, start_reaper
from rlcore.controller.timing import StepTimer, summarize
from rlcore.controller.workers import LocalTrainer, RayTrainerGroup, init_distributed
from rlcore.data.row_limits import check_rows, text_problem
from rlcore.generation.batching import Trajectory, sampling_params, to_sequence_batch
from rlcore.loading.loader import to_dict
from rlcore.planning.runtime import choose as choose_layout
from rlcore.planning.runtime import describe as describe_layout

__all__ = [
    "PUBLIC_MODULES", "CheckpointManager", "LocalTrainer", "RayTrainerGroup", "StepTimer", "StreamTransport", "Trajectory",
    "check_prompt_lengths", "check_rows", "choose_layout", "describe_layout", "export_checkpoint", "init_distributed",
    "plan_placement", "sampling_params", "start_local_ray", "start_reaper", "summarize", "text_problem", "to_dict",
    "to_sequence_batch",
]

# Modules (and, with a trailing ".", packages with all their modules) that plugin and example code may import.
PUBLIC_MODULES = (
    "rlcore",  # run, load_config, build_config, hookimpl, get_plugin_manager
    "rlcore.interfaces.",  # the protocols at every boundary and the data they pass
    "rlcore.hookspecs",  # the hooks a plugin implements
    "rlcore.plugins",  # registration helpers and the plugin manager
    "rlcore.runtime",  # this module
    "rlcore.config.",  # configs, ConfigError, doc()
    "rlcore.algorithms.",  # the registered algorithms, their configs and shared pieces
    "rlcore.data.",  # prompt, preference and image datasets, rows, reward functions, packing
    "rlcore.training.",  # what backends share: optimizer steps, logprobs, attention, LoRA, weights, schedules
    "rlcore.generation.",  # the built-in transformers generator, multi-turn rollouts, trajectories
    "rlcore.testing.",  # conformance suites and tiny-model fixtures
    "rlcore.errors",  # DataError and the other errors a plugin may raise
    "rlcore.utils",  # resolve, torch_dtype, free_port, local_model_dir
)


def is_public(module: str) -> bool:
    """Whether ``module`` (a dotted name inside ``rlcore``) is one plugin code may import."""
    return any(module == p or (p.endswith(".") and (module == p[:-1] or module.startswith(p))) for p in PUBLIC_MODULES)
