"""The loop of the families that train on fixed examples (SFT, DPO, reward models): no rollouts.

:mod:`rlcore.controller.sft` and :mod:`rlcore.controller.pairs` plug their trainer into
:class:`OfflineLoop` through :class:`OfflineSteps`. Each step draws ``train.num_prompts_per_step``
examples (a :class:`~rlcore.controller.batching.DataCursor`: seeded, epoch-wise order) and trains
on them; every ``train.val_period`` steps (and before the first with ``train.val_at_start``) the
first ``train.max_val_samples`` held-out examples are evaluated. Records go to the loggers and
carry ``timing/*`` and ``time/elapsed_s`` as the GRPO loop's do.

Checkpoints have the GRPO loop's semantics (:mod:`rlcore.controller.checkpoint`): every
``checkpointing.save_period`` steps the trainer's state (model, optimizer, scheduler, its RNG)
and the loop's (step, data position, driver RNG, records, the run's fingerprint) are written to
``step_N.tmp`` and renamed when complete; a run started again with the same ``logger.log_dir``
resumes from the newest one that is its own. SIGTERM ends the run after the current step with
a checkpoint of that step (``rlcore run`` then exits 143).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rlcore.controller.batching import DataCursor
from rlcore.controller.checkpoint import (
    CheckpointManager, resume_loggers, rng_state, run_catching_sigterm, set_rng_state, stop_after_step,
)
from rlcore.controller.heartbeat import doing, said
from rlcore.controller.nonfinite import NonfiniteStreak
from rlcore.controller.run_dir import check_owner, checkpoint_root
from rlcore.controller.run_end import print_outputs, save_final_checkpoint, write_model, write_summary
from rlcore.controller.timing import StepTimer
from rlcore.interfaces import MetricLogger, TrainerHandle
from rlcore.plugins import get_plugin_manager


def trains_on(config: Any) -> str | None:
    """The ``trains_on`` capability of the recipe's algorithm: ``"pairs"`` (dpo, reward_model),
    ``"answers"`` (sft) or None (the GRPO loop: the policy's own rollouts)."""
    section = config.section("algorithm")
    if section is None:
        return None
    return get_plugin_manager().get("algorithm", section.name).capabilities.get("trains_on")


def build_loggers(config: Any, run_dir: Any) -> list[MetricLogger]:
    """The enabled logger plugins (``logger.<name>.enabled``), writing under ``run_dir``."""
    manager, loggers = get_plugin_manager(), []
    for reg in manager.registry["logger"].values():
        section = config.section(reg.section)
        if section is not None and section.enabled:
            loggers.append(reg.build(section, run_dir))
    return loggers


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


class OfflineLoop:
    def __init__(self, config: Any, identity: dict, steps: OfflineSteps, train: Sequence[Any],
                 validation: Sequence[Any] | None, loggers: list[MetricLogger], label: str, print_lines: bool = True):
        self.config, self.identity, self.steps, self.loggers, self.label = config, identity, steps, loggers, label
        self.loop = config.train
        self.train_examples = train
        self.validation = list(validation or [])[: self.loop.max_val_samples]
        self.cursor = DataCursor(len(train), self.loop.seed)
        self.step = 0
        self.records: list[dict] = []
        cfg = config.checkpointing
        self.ckpt = CheckpointManager(checkpoint_root(config), cfg.keep_last_k) if cfg.enabled else None
        self.saved_step = -1
        self.started, self.elapsed_before = time.perf_counter(), 0.0
        self.stop_signal: int | None = None
        self.print_lines = print_lines
        self.nonfinite = NonfiniteStreak(self.loop.max_consecutive_nonfinite)

    def run(self) -> list[dict]:
        return run_catching_sigterm(self, self._run, checkpointed=self.ckpt is not None,
                                    timeout_s=self.config.cluster.timeout_s)

    def _run(self) -> list[dict]:
        self.maybe_resume()
        if self.loop.val_at_start and self.step == 0 and self._can_validate():
            record = {"step": 0, **self.steps.evaluate(self.validation)}
            record["time/elapsed_s"] = self.elapsed()
            self.records.append(record)
            self._emit(record)
        while self.step < self.loop.max_num_steps:
            self.step += 1
            timer = StepTimer()
            examples = [self.train_examples[i] for i in self.cursor.take(self.loop.num_prompts_per_step)]
            with timer.phase("training"):
                record = dict(self.steps.train(examples))
            self.nonfinite.after_step(bool(record.get("train/skipped_nonfinite")), self.step)
            if self.loop.val_period and self.step % self.loop.val_period == 0 and self._can_validate():
                with timer.phase("validation"):
                    record.update(self.steps.evaluate(self.validation))
            self.finish_step(record, timer)
            if self.stop_requested():
                break
        return self.records

    def _can_validate(self) -> bool:
        return self.steps.evaluate is not None and bool(self.validation)

    def finish_step(self, record: dict, timer: StepTimer) -> None:
        record.update(timer.finish())
        record["step"] = self.step
        record["data_position"] = self.cursor.position  # the examples (pairs) drawn up to this step's batch, as GRPO's
        self.records.append(record)
        record["time/elapsed_s"] = self.elapsed()  # before saving, so that a resumed run counts on from it
        if self.ckpt is not None and self.step % self.config.checkpointing.save_period == 0:
            with timer.phase("checkpoint"):
                self.save()
            record.update(timer.finish())
        record["time/elapsed_s"] = self.elapsed()
        self._emit(record)

    def _emit(self, record: dict) -> None:
        for logger in self.loggers:
            logger.log({k: v for k, v in record.items() if k != "step"}, record["step"])
        if self.print_lines:
            shown = {k: record[k] for k in self.steps.shown if k in record}
            print(f"{self.label} step {record['step']:4d}  " + "  ".join(f"{k} {v:.4f}" for k, v in shown.items()), flush=True)
            said()
        doing(f"{self.label} step {record['step'] + 1}")

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self) -> None:
        state = {"step": self.step, "data_position": self.cursor.position, "records": self.records,
                 "rng": rng_state(), "run": self.identity, "nonfinite_in_a_row": self.nonfinite.in_a_row}
        self.ckpt.save(self.step, self.steps.save_checkpoint, state)
        self.saved_step = self.step

    def maybe_resume(self) -> None:
        if self.ckpt is None or not self.config.checkpointing.resume:
            return
        found = self.ckpt.resume(lambda path, state: check_owner(state.get("run"), self.identity, path),
                                 lambda path: self.steps.load_checkpoint(str(path)))
        if found is None:
            return
        latest, state = found
        self.step, self.cursor.position, self.records = state["step"], state["data_position"], state["records"]
        self.nonfinite.in_a_row = state.get("nonfinite_in_a_row", 0)  # absent from older checkpoints
        self.started = time.perf_counter()
        self.elapsed_before = self.records[-1].get("time/elapsed_s", 0.0) if self.records else 0.0
        set_rng_state(state["rng"])
        resume_loggers(self.loggers, self.step, self.records)  # steps after the checkpoint are redone; missing ones restored
        print(f"resumed from {latest} at step {self.step}", flush=True)

    def stop_requested(self) -> bool:
        """After a step: whether SIGTERM arrived; if so, checkpoint this step (unless just done)."""
        return stop_after_step(self, checkpoint_root(self.config))

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
        save_final_checkpoint(loop)  # the last step's, when save_period did not fall on it
        if loop.stop_signal is None or loop.ckpt is None:
            write_model(run_dir, config, lambda path: trainer.save(str(path)))
    finally:
        for logger in loggers:
            logger.close()
        trainer.shutdown()
    summary = loop.summary(owner.run_id, time.perf_counter() - started)
    for key in summary_keys:
        summary.setdefault(key, None)
    write_summary(run_dir, summary)
    print_outputs(run_dir, config)
    return {"summary": summary, "records": loop.records, "run_dir": str(run_dir), "model_dir": str(run_dir / "model")}
