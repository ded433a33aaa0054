"""The loop of the families that train on fixed examples (SFT, DPO, reward models): no rollouts.

:mod:`rlcore.controller.sft` and :mod:`rlcore.controller.pairs` plug their trainer into
:class:`OfflineLoop` through :class:`OfflineSteps`. Each step draws ``train.num_prompts_per_step``
examples (a :class:`~rlcore.generation.batching.DataCursor`: seeded, epoch-wise order) and trains
on them; every ``train.val_period`` steps (and before the first with ``train.val_at_start``) the
first ``train.max_val_samples`` held-out examples are evaluated. Records go to the loggers and
carry ``timing/*`` and ``time/elapsed_s`` as the GRPO loop's do.

Start, records, checkpoints, loggers and stops are the run skeleton's, the GRPO loop's too
(:mod:`rlcore.controller.run_skeleton`): every ``checkpointing.save_period`` steps the trainer's state (model, optimizer, scheduler, its RNG)
and the loop's (step, data position, driver RNG, records, the run's fingerprint) are written to
``step_N.tmp`` and renamed when complete; a run started again with the same ``logger.log_dir``
resumes from the newest one that is its own. SIGTERM ends the run after the current step with
a checkpoint of that step (``rlcore run`` then exits 143); each logger call is bounded by
``cluster.timeout_s``; ``train.max_consecutive_nonfinite`` skipped updates in a row stop the run.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rlcore.generation.batching import DataCursor
from rlcore.controller.checkpoint import CheckpointManager
from rlcore.deadlines import bounded_teardown
from rlcore.controller.heartbeat import doing, said
from rlcore.controller.run_end import print_outputs, save_final_checkpoint, write_model, write_summary
from rlcore.controller.run_skeleton import LoopParts, RunPosition, RunSkeleton, build_loggers
from rlcore.controller.timing import StepTimer
from rlcore.interfaces import MetricLogger, TrainerHandle


class BackendPolicy:
    """What an offline run's trainer does through a training backend (``self.trainer``, a
    :class:`rlcore.interfaces.TrainerHandle`) for :class:`OfflineSteps` and :func:`run_offline`:
    the final model in Hugging Face format, the backend's own checkpoints, shutdown."""

    trainer: TrainerHandle

    def save(self, path: str) -> None:
        self.trainer.run_on_ranks("rlcore.controller.offline:export_hf_on_rank", path, what="export_hf")

    def save_checkpoint(self, path: str) -> None:
        self.trainer.save_checkpoint(path)  # the backend's own: model, optimizer, scheduler, RNG

    def load_checkpoint(self, path: str) -> None:
        self.trainer.load_checkpoint(path)

    def shutdown(self) -> None:
        self.trainer.shutdown()


def export_hf_on_rank(backend: Any, rank: int, world_size: int, path: str) -> None:
    backend.export_hf(path)  # a collective: every rank takes part, rank 0 writes


@attrs.define
class OfflineSteps:
    """What a family does in the offline loop."""

    train: Callable[[list[Any]], dict[str, float]]  # one step on these examples; metrics under train/
    evaluate: Callable[[list[Any]], dict[str, float]] | None  # held-out metrics under val/; None: no validation
    save_checkpoint: Callable[[str], None]  # the trainer's state into a new directory
    load_checkpoint: Callable[[str], None]  # and back
    shown: tuple[str, ...] = ("train/loss", "val/loss", "val/accuracy")  # the per-step line's (logger.print_table)


class OfflineLoop(RunPosition):
    """Draws each step's examples and trains on them, plugged into the run skeleton every algorithm
    shares (:class:`~rlcore.controller.run_skeleton.RunSkeleton`: start, resume, records, checkpoints,
    bounded loggers, stop on signals and non-finite streaks)."""

    def __init__(self, config: Any, identity: dict, steps: OfflineSteps, train: Sequence[Any],
                 validation: Sequence[Any] | None, loggers: list[MetricLogger], label: str, print_lines: bool = True):
        self.config, self.steps, self.label = config, steps, label
        self.loop = config.train
        self.train_examples = train
        self.validation = list(validation or [])[: self.loop.max_val_samples]
        self.cursor = DataCursor(len(train), self.loop.seed)
        self.print_lines = print_lines
        can_validate = steps.evaluate is not None and bool(self.validation)
        parts = LoopParts(save_backend=steps.save_checkpoint, load_backend=steps.load_checkpoint,
                          data_position=lambda: self.cursor.position, set_data_position=self._set_data_position,
                          validate=self._validate if can_validate else None, show=self._show)
        self.skeleton = RunSkeleton(config, identity, parts, loggers)
        self.progress = self.skeleton.progress

    @property
    def ckpt(self) -> CheckpointManager | None:
        return self.skeleton.ckpt

    def run(self) -> list[dict]:
        return self.skeleton.run(self._steps)

    def _steps(self) -> None:
        run = self.skeleton
        while run.more_steps():
            run.next_step()
            timer = StepTimer()
            examples = [self.train_examples[i] for i in self.cursor.take(self.loop.num_prompts_per_step)]
            with timer.phase("training"):
                record = dict(self.steps.train(examples))
            run.trained(bool(record.get("train/skipped_nonfinite")))
            run.finish_step(record, timer)
            if run.stop_requested():
                break

    def _validate(self, step: int) -> dict[str, float]:
        return self.steps.evaluate(self.validation)

    def _set_data_position(self, position: int) -> None:
        self.cursor.position = position

    def _show(self, record: dict) -> None:
        if self.print_lines:
            shown = {k: record[k] for k in self.steps.shown if k in record}
            print(f"{self.label} step {record['step']:4d}  " + "  ".join(f"{k} {v:.4f}" for k, v in shown.items()), flush=True)
            said()
        doing(f"{self.label} step {record['step'] + 1}")

    def summary(self, run_id: str, seconds: float) -> dict:
        """The run's summary: steps, first and last held-out metrics, the signal that stopped it."""
        vals = [r for r in self.records if any(k.startswith("val/") for k in r)]
        out: dict[str, Any] = {"steps": self.step, "run_id": run_id, "seconds": seconds,
                               "stopped_by_signal": None if self.stop_signal is None else signal.Signals(self.stop_signal).name}
        for key in sorted({k for r in vals for k in r if k.startswith("val/")}):
            seen = [r[key] for r in vals if key in r]
            out[f"{key}_first"], out[f"{key}_last"] = seen[0], seen[-1]
        out.setdefault("val/accuracy_first", None)
        out.setdefault("val/accuracy_last", None)
        return out


def run_offline(config: Any, owner: Any, run_dir: Any, given: dict, trainer: Any, steps: OfflineSteps,
                train: Sequence[Any], validation: Sequence[Any], kind: str, summary_keys: Sequence[str]) -> dict:
    """An offline run in ``run_dir`` (opened by ``rlcore.run``) with its loop, loggers, final model
    (``run_dir/model``, unless a signal stopped it: its model is in its checkpoint) and
    ``summary.json``; ``summary_keys`` are present in the summary even when never measured."""
    run_dir = Path(run_dir)
    loggers = given.get("loggers")
    if loggers is None:
        loggers = build_loggers(config, run_dir)
    loop = OfflineLoop(config, owner.identity(), steps, train, validation, loggers, kind, print_lines=config.logger.print_table)
    started = time.perf_counter()
    try:
        loop.run()
        save_final_checkpoint(loop.skeleton)  # the last step's, when save_period did not fall on it
        if loop.stop_signal is None or loop.ckpt is None:
            write_model(run_dir, config, lambda path: trainer.save(str(path)))
    finally:  # each bounded, as the GRPO run's: a part that hangs as the run ends is named and left behind
        loop.skeleton.close_loggers()
        bounded_teardown(trainer.shutdown, "the trainer (shutdown)", config.cluster.timeout_s)
    summary = loop.summary(owner.run_id, time.perf_counter() - started)
    for key in summary_keys:
        summary.setdefault(key, None)
    write_summary(run_dir, summary)
    print_outputs(run_dir, config)
    return {"summary": summary, "records": loop.records, "run_dir": str(run_dir), "model_dir": str(run_dir / "model")}
