"""The refitter: the trainer's weights to the generator, then the refit probe.

The transfer and the probe's generator pass share one hold of the generator's lock. Released in
between, a rollout thread waiting for the lock (async) could take it first and generate a whole
batch, and the probe, and with it the trainer's next step, would wait for all of it.

The transfer and the probe's scoring are each bounded by ``cluster.timeout_s`` (a generator engine
or a transport that hangs stops the run naming what it was doing); the trainer's part of the probe
is bounded by the trainer handle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rlcore.config.generation import RefitConfig
from rlcore.deadlines import GenerationTimeout, call_with_timeout
from rlcore.controller.context import RunContext
from rlcore.controller.refit_probe import compare_probe_logprobs, refit_probe_sequences
from rlcore.controller.timing import StepTimer
from rlcore.controller.rollouts import image_generator
from rlcore.interfaces import Generator, SequenceBatch, TrainerHandle, WeightTransport


class Refitter:
    """Moves weights through ``transport`` and checks them with the probe (``policy.generation.refit``)."""

    def __init__(self, trainer: TrainerHandle, generator: Generator, transport: WeightTransport, config: RefitConfig,
                 context: RunContext):
        self.trainer, self.generator, self.transport, self.config = trainer, generator, transport, config
        self.generator_lock, self.max_len = context.generator_lock, context.max_sequence_length
        self.timeout_s = context.timeout_s  # None: unbounded

    def _bounded(self, fn: Callable[[], Any], what: str) -> Any:
        if self.timeout_s is None:
            return fn()
        limit = self.timeout_s
        return call_with_timeout(fn, limit, lambda: f"timeout: the refit's {what} did not finish within {limit:g}s "
                                                    "(cluster.timeout_s)", GenerationTimeout)

    def transfer(self) -> dict[str, float]:
        """The weights alone, no probe (a resumed run's first refit)."""
        name = self.transport.name
        return self._bounded(lambda: self.transport.transfer(self.trainer, self.generator), f"weight transfer ('{name}')")

    def refit(self, probe_batch: SequenceBatch | None, timer: StepTimer, step: int,
              generator_free: Callable[[], None] | None = None,
              on_hold: Callable[[float], dict[str, float]] | None = None) -> dict[str, float]:
        """Weights to the generator, then the probe. ``on_hold(held_from)`` runs with the generator held
        (its metrics join the refit's); ``generator_free()`` once the generator is no longer needed (async:
        the rollout thread may start the next batch while the trainer compares)."""
        with timer.phase("refit"), self.generator_lock:
            held_from = time.perf_counter()
            extra = on_hold(held_from) if on_hold is not None else {}
            moved = self.transfer()
            probed = (self._bounded(lambda: self._probe_generator(probe_batch), f"probe scoring by the generator at step {step}")
                      if probe_batch is not None else None)
            held_s = time.perf_counter() - held_from
        if generator_free is not None:
            generator_free()
        metrics = {"refit/seconds": float(moved.get("seconds", 0.0)), "refit/bytes": float(moved.get("bytes", 0.0)),
                   "refit/generator_hold_s": held_s, **extra}  # the generator's time taken by transfer and probe
        if metrics["refit/seconds"] > 0:
            metrics["refit/gb_per_s"] = metrics["refit/bytes"] / metrics["refit/seconds"] / 1e9
        if probed is not None:
            with timer.phase("refit"):
                metrics.update(self._compare_probe(*probed, step))
        return metrics

    def _probe_generator(self, batch: SequenceBatch) -> tuple[SequenceBatch, list] | None:
        """The probe's sequences and the generator's logprobs of them (the caller holds the lock)."""
        count = self.config.probe_num_sequences
        if count <= 0:
            return None
        probe = refit_probe_sequences(batch, count, self.max_len)  # scorable at the length limit
        sequences = [ids.tolist() for ids in probe.input_ids]
        if probe.images is not None:  # image prompts: the generator scores them with their images
            return probe, image_generator(self.generator).score_with_images(sequences, probe.images)
        return probe, self.generator.score(sequences)

    def _compare_probe(self, probe: SequenceBatch, gen_lp: list, step: int) -> dict[str, float]:
        train_lp = self.trainer.logprobs(probe, what="'logprobs' (refit probe)")
        return compare_probe_logprobs(probe, gen_lp, train_lp, self.config.probe_threshold, step)
