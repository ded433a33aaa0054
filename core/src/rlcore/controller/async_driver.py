"""Async GRPO: one thread generates batch after batch, another scores them, the trainer trains.

A batch older than ``max_trajectory_age_steps`` policy versions is dropped (counted), and the
algorithm's off-policy correction uses the generator's own logprobs. Refit waits for the generator
to be between batches (its lock), and, until the last step, for the rollout thread to have begun
the next batch's generation: otherwise a rollout thread slow to reach the lock (one that waits for
the interpreter lock while the trainer's thread launches kernels) generates after every refit, and
"one step off" trains on fresh batches with no overlap at all.

In one step off the generator is the step's critical path: batch k+1 is generated beside step k's
training, the refit waits for that generation, and the next one starts after the refit. Whatever
the rollout thread does between two generations leaves the engine idle. Scoring a batch is most of
that, so a batch's scoring runs in a thread of its own while the rollout thread goes back to the
generator. DAPO's refill rounds need a batch's scores before the next round, so with refill the
rollout thread scores its batches itself.

How far the producer may run ahead: generation ``j`` begins only after the trainer is done with
batch ``j - 1 - max_trajectory_age_steps`` (trained on it and refitted the generator, or dropped
it), so every batch is sampled with weights young enough to be trained on; and only after the
trainer took batch ``j - 2`` off the queue (``credits``). With one step off the first rule orders
each refit before the next generation. The generator's lock alone cannot give that order: a
released ``threading.Lock`` goes to whichever thread asks first, and a rollout thread back at the
lock at once would win it and sample a batch two steps old.

Each batch carries ``async/generator_idle_s``: how long the generator sat between the end of the
previous generation and the start of this one (the refit's hold of the generator plus the rollout
thread's own work), the number one step off is meant to keep near zero; and
``async/generator_waits_for_trainer_s``, the part of it the rollout thread spent blocked on the
trainer (its refit of the batch before, or its taking of a batch off the queue), and
``async/generator_start_s``, the part from the trainer's release to the generation's start (the
next prompts, the generator's lock); ``async/generator_wake_after_done_s`` and ``..._after_credit_s``
say which release it waited for (a batch done with, a batch taken) and how long it took to go on.
What remains of the idle time is the rollout thread's hand-off of the finished batch, before it
waits. The trainer's record of the refit carries ``async/refit_after_generation_s``: from the end
of the generation the refit waited for to the refit's hold of the generator.

The rollout thread reaches the rollouts only through :class:`~rlcore.controller.rollouts.RolloutSource`.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import TYPE_CHECKING

import attrs

from rlcore.controller.checkpoint import StopSignalled, ended_by_stop
from rlcore.deadlines import batch_margin_s
from rlcore.controller.timing import StepTimer
from rlcore.errors import RolloutError, RunStopped

if TYPE_CHECKING:
    from rlcore.generation.batching import Trajectory
    from rlcore.controller.loop import GRPOLoop
    from rlcore.controller.rollouts import RolloutSource

# Generations begun before the trainer takes the batch two before them (module docstring).
BATCHES_AHEAD = 2


class RolloutTimeout(TimeoutError, RunStopped):
    """The trainer waited longer than ``cluster.timeout_s`` for the rollout thread."""


@attrs.define
class Produced:
    """One batch for the trainer."""

    trajectories: list[Trajectory]
    metrics: dict
    version: int  # the generator's weights version the batch was sampled with
    timer: StepTimer  # its generation and reward phases
    generations_before: int  # generations begun when this one ended: "begun after this batch" counts from it
    data_position: int  # prompts drawn once this batch's were: where a checkpoint after training on it resumes


class RolloutProducer:
    """The rollout and scoring threads of :func:`run_async`, and what the trainer asks of them."""

    def __init__(self, rollouts: RolloutSource, first_step: int, last_step: int, timeout_s: float, max_age: int):
        self.rollouts = rollouts
        self.timeout_s = timeout_s
        self.max_age = max_age
        self._first_step = first_step
        self._next_step = first_step  # the step number of the batch begun last
        self._wanted = last_step - first_step  # batches the trainer will take: one a step, one more per dropped batch
        self._done = 0  # batches the trainer is done with (trained and refitted, or dropped)
        self._done_changed = threading.Condition()
        self._batches: queue.Queue[Produced] = queue.Queue()
        self._credits = threading.Semaphore(BATCHES_AHEAD)
        self._stop = threading.Event()
        self._failure: list[BaseException] = []
        self._generations = 0
        self._began = threading.Condition()
        self.last_generation_end: float | None = None
        self._done_at = self._credit_at = 0.0  # when the trainer last finished a batch, last took one
        self._progress_at = time.monotonic()  # when the rollout side last began or ended a bounded phase
        self._scoring = _ScoringThread(self._failure)
        self.thread = threading.Thread(target=self._produce, name="rlcore-rollouts", daemon=True)

    # ---- the rollout thread ------------------------------------------------------------------
    def start(self) -> None:
        self._scoring.start()
        self.thread.start()

    def generation_began(self) -> None:
        """Called with the generator's lock held, as the rollout thread's generation begins."""
        self._progress_at = time.monotonic()
        with self._began:
            self._generations += 1
            self._began.notify_all()

    def generation_ended(self) -> None:
        self._progress_at = time.monotonic()
        self.last_generation_end = time.perf_counter()

    def _produce(self) -> None:
        rollouts = self.rollouts
        try:
            while not self._stop.is_set():
                begun = self._next_step - self._first_step  # batches begun in this run
                blocked_from = time.perf_counter()
                if not (self._wait_until_wanted(begun) and self._take_credit() and self._wait_for_done(begun - self.max_age)):
                    return
                released = time.perf_counter()
                wakes = self._wakes(blocked_from, released)
                self._next_step += 1
                timer = StepTimer()
                if rollouts.refill_rounds():
                    kept, metrics, version = rollouts.collect(self._next_step, timer, observer=self)
                    self._batches.put(Produced(kept, metrics, version, timer, self._generations, rollouts.data_position()))
                    continue
                idle_since = self.last_generation_end
                generated = rollouts.generate_round(self._next_step, 0, timer, observer=self)
                metrics = {} if idle_since is None else {"async/generator_idle_s": max(0.0, generated.began - idle_since),
                                                         "async/generator_waits_for_trainer_s": released - blocked_from,
                                                         "async/generator_start_s": max(0.0, generated.began - released),
                                                         **wakes}
                metrics.update(rollouts.generator_metrics())
                count, position = self._generations, rollouts.data_position()
                self._scoring.submit(lambda g=generated, t=timer, m=metrics, n=count, d=position:
                                     self._score_and_put(g, t, m, n, d))
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread
            self._failure.append(exc)

    def _wakes(self, blocked_from: float, released: float) -> dict[str, float]:
        """How long after the trainer's last release of each kind (done with a batch, took one) the rollout
        thread went on, for a release while it waited (else 0): which one it waited for, and how fast it woke."""
        return {f"async/generator_wake_after_{kind}_s": released - at if blocked_from < at <= released else 0.0
                for kind, at in (("done", self._done_at), ("credit", self._credit_at))}

    def _take_credit(self) -> bool:
        while not self._stop.is_set():
            if self._credits.acquire(timeout=0.5):
                return True
        return False

    def _wait_until_wanted(self, begun: int) -> bool:
        """Until the trainer wants more than ``begun`` batches (False: the run is ending): no batch is
        rolled out past the run's last step, unless a stale one was dropped and must be replaced."""
        with self._done_changed:
            while begun >= self._wanted:
                if self._stop.is_set():
                    return False
                self._done_changed.wait(timeout=0.5)
        return True

    def _wait_for_done(self, count: int) -> bool:
        """Until the trainer is done with ``count`` batches (False: the run is ending)."""
        with self._done_changed:
            while self._done < count:
                if self._stop.is_set():
                    return False
                self._done_changed.wait(timeout=0.5)
        return True

    def _score_and_put(self, generated, timer: StepTimer, metrics: dict, count: int, position: int) -> None:
        self._progress_at = time.monotonic()
        kept, scored, version = self.rollouts.finish_collect([generated], timer)
        self._batches.put(Produced(kept, {**scored, **metrics}, version, timer, count, position))

    # ---- the trainer's side -------------------------------------------------------------------
    def next_batch(self) -> Produced:
        """The next batch (a credit back to the rollout thread); raises the rollout side's failure.

        Each phase of the rollout side (a generation, a batch's scoring) is bounded by
        ``cluster.timeout_s`` on its own, and its error names what hung (the environment, the
        generator): this wait gives up only once no phase has begun or ended for longer than that
        and a margin, so that error comes first."""
        began = time.monotonic()
        limit = self.timeout_s + batch_margin_s(self.timeout_s)
        while True:
            self.raise_if_failed()
            try:
                item = self._batches.get(timeout=1.0)
            except queue.Empty:
                idle = time.monotonic() - max(began, self._progress_at)
                if idle > limit:
                    self.raise_if_failed()  # failed while this waited: that error, not this one
                    raise RolloutTimeout(f"timeout: the trainer waited {idle:.0f}s (cluster.timeout_s) for the rollout "
                                         "thread's next batch, which neither generated nor scored meanwhile") from None
                continue
            self._credit_at = time.perf_counter()
            self._credits.release()
            return item

    def batch_done(self, dropped: bool = False) -> None:
        """The trainer is done with the batch it took last: refitted after training on it, or
        ``dropped`` it (then one more batch is wanted in its place)."""
        with self._done_changed:
            self._done += 1
            self._wanted += dropped
            self._done_at = time.perf_counter()
            self._done_changed.notify_all()

    def await_generation_after(self, count: int, step: int) -> None:
        """Until the rollout thread has begun a generation after the first ``count`` (module docstring)."""
        deadline = time.monotonic() + self.timeout_s
        with self._began:
            while self._generations <= count:
                self.raise_if_failed()
                if time.monotonic() > deadline:
                    raise RolloutTimeout(f"timeout: the trainer waited {self.timeout_s:g}s (cluster.timeout_s) for the "
                                       f"rollout thread to begin its next generation at step {step}")
                self._began.wait(timeout=1.0)

    def refit_metrics(self, held_from: float) -> dict[str, float]:
        """Called by the refit with the generator held: from the end of the generation it waited for to its hold."""
        ended = self.last_generation_end
        return {} if ended is None else {"async/refit_after_generation_s": held_from - ended}

    def raise_if_failed(self) -> None:
        """The rollout or scoring thread's exception, if one died, raised in the trainer's thread."""
        if self._failure:
            if isinstance(self._failure[0], (RolloutError, RunStopped)):  # its message names what failed: shown as it is
                raise self._failure[0]
            raise RuntimeError(f"the rollout thread failed: {self._failure[0]!r}") from self._failure[0]

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=self.timeout_s)
        self._scoring.close(self.timeout_s)


def run_async(run: GRPOLoop) -> None:
    """Trains batch after batch from the rollout thread, each at most ``max_trajectory_age_steps`` old."""
    max_age = run.grpo.async_grpo.max_trajectory_age_steps
    producer = RolloutProducer(run.rollouts, run.step, run.train_cfg.max_num_steps, run.context.timeout_s, max_age)
    producer.start()
    dropped = 0
    # The policy version each of the generator's weights versions holds: the two count differently (a
    # resumed run's generator starts again from its own first version; a skipped non-finite update is
    # refitted but is no new policy version).
    policy_of = {run.c.generator.weights_version: run.learner.policy_version}
    try:
        while run.step < run.train_cfg.max_num_steps:
            # The step's time counts from here: a step that waits for its batch takes that long too.
            waiting_since = time.perf_counter()
            produced = producer.next_batch()
            age = run.learner.policy_version - policy_of[produced.version]
            if age > max_age:
                dropped += 1
                producer.batch_done(dropped=True)
                continue
            step = run.next_step()
            timer = StepTimer()
            timer.start = waiting_since
            timer.phases.update(produced.timer.phases)
            record = produced.metrics
            record.update({"async/trajectory_age": float(age), "async/dropped_stale_batches": float(dropped),
                           "async/batch_wait_s": time.perf_counter() - waiting_since})
            metrics, batch = run.train(produced.trajectories, timer)
            run.checkpoints.trained_position = produced.data_position
            record.update(metrics)
            # A validation step's held-out pass takes the generator before the next batch does.
            validates = run.validates()
            # A stop signal ends the refit and the wait for the generation it follows: only a later step needs them.
            with contextlib.suppress(StopSignalled), ended_by_stop(run.progress):
                if step < run.train_cfg.max_num_steps:
                    with timer.phase("refit"):
                        producer.await_generation_after(produced.generations_before, step)
                record.update(run.refitter.refit(batch, timer, step, generator_free=None if validates else producer.batch_done,
                                                 on_hold=producer.refit_metrics))
                policy_of[run.c.generator.weights_version] = run.learner.policy_version  # refits happen on this thread only
            run.finish_step(record, timer)
            if validates:
                producer.batch_done()
            if run.stop_requested():
                break
    finally:
        producer.close()


class _ScoringThread:
    """Runs the rollout thread's scoring jobs one after another, in order; a failure is recorded for the trainer.

    Not a one-worker ``ThreadPoolExecutor``: its workers are joined at interpreter exit, so a hung
    environment call would keep a finished or failed run from exiting; this thread is a daemon."""

    def __init__(self, failure: list[BaseException]):
        self._jobs: queue.Queue = queue.Queue()
        self._failure = failure
        self._thread = threading.Thread(target=self._run, name="rlcore-scoring", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._failure:
                continue  # the run is ending; later batches are not needed
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread
                self._failure.append(exc)

    def close(self, timeout_s: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)
