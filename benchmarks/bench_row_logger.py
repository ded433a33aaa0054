"""A metric logger that hands the bench its run's records as soon as the GRPO loop ends.

``rlcore.run`` closes its loggers before it shuts the trainer and the engines down, and that
shutdown (vLLM's engine process above all) can take longer than a device call has left: a bench
that built its row only after ``rlcore.run`` returned lost the row of a run that had finished every
step. ``bench_grpo_step.py`` registers this module as a plugin, enables ``logger.bench_row`` and sets
:data:`on_loop_end`; :meth:`LoopEndLogger.close` calls it with ``{"summary", "records"}`` shaped
like ``rlcore.run``'s result, when all ``train.max_num_steps`` steps were logged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from attrs import field, frozen

from rlcore import hookimpl
from rlcore.config.structure import doc

# Set by the bench before rlcore.run: called once with the finished loop's summary and records.
on_loop_end: Callable[[dict], None] | None = None


@frozen
class LoopEndLoggerConfig:
    enabled: bool = field(default=False, metadata=doc("hand the bench its records when the loop ends"))
    steps: int = field(default=0, metadata=doc("steps the run must have logged (train.max_num_steps)"))
    window_first: int = field(default=1, metadata=doc("first step of the summary window"))
    window_last: int = field(default=0, metadata=doc("last step of the summary window"))


class LoopEndLogger:
    def __init__(self, config: LoopEndLoggerConfig, run_dir: Path):
        self.config = config
        self.records: list[dict] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.records.append({"step": step, **metrics})

    def close(self) -> None:
        from rlcore.runtime import summarize

        steps = [r for r in self.records if "timing/total" in r]
        if on_loop_end is None or len(steps) < self.config.steps:
            return  # a failed or stopped run: the bench reports it from rlcore.run's error
        summary = summarize(steps, (self.config.window_first, self.config.window_last))
        on_loop_end({"summary": summary, "records": self.records})


@hookimpl
def rlcore_loggers(register):
    register("bench_row", "bench_row_logger:LoopEndLogger", LoopEndLoggerConfig)
