"""The rollout traces' section (``logger.rollouts``): which trajectories of each step are written to
``<logger.log_dir>/<filename>`` and how many bytes they may take (:mod:`rlcore.loggers.traces`)."""

from __future__ import annotations

import attrs
from attrs import field, frozen

from rlcore.config.structure import doc
from rlcore.config.run_paths import check_output_name

_positive = attrs.validators.gt(0)
_non_negative = attrs.validators.ge(0)


def inside_log_dir(section: str):
    """A validator: a plain relative file name inside ``logger.log_dir`` (under the run's lock) that
    is none of the run's own files (:func:`rlcore.config.run_paths.check_output_name`); ``section`` names
    the key in the error."""

    def check(instance, attribute, value: str) -> None:
        check_output_name(value, f"{section}.{attribute.name}")

    return check


@frozen
class RolloutTracesConfig:
    """Rollout traces: per trajectory, what was generated, rewarded and trained (``rlcore rollouts RUN``)."""

    enabled: bool = field(default=True, metadata=doc("write rollout traces (a sample of each training step's trajectories)"))
    per_step: int = field(default=8, validator=_positive,
                          metadata=doc("trajectories traced per step, spread over the step's rewards from worst to best "
                                       "(an agent's earlier segments and failed attempts come with them)"))
    max_step_bytes: int = field(default=200_000, validator=_positive,
                                metadata=doc("bytes of one step's traces; a trajectory over what is left keeps its texts "
                                             "and scores, its per-token lists are left out (marked)"))
    max_run_bytes: int = field(default=50_000_000, validator=_non_negative,
                               metadata=doc("bytes of the whole file; once reached, no more steps are traced (a note says so)"))
    table_rows: int = field(default=4, validator=_non_negative,
                            metadata=doc("traces per step shown as a table by the TensorBoard and W&B loggers (when enabled)"))
    filename: str = field(default="rollouts.jsonl", validator=inside_log_dir("logger.rollouts"),
                          metadata=doc("file name inside logger.log_dir (relative, no '.' or '..' parts, not one "
                                       "of the run's own files or directories)"))
