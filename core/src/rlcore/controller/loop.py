"""One GRPO step after another: the data path of DESIGN.md, sync or async.

Sync (on-policy): generate with policy version k, score, compute advantages, logprobs, train,
refit. Async: a rollout thread keeps generating the next batch with whatever weights the
generator holds while the trainer trains, and another thread scores each batch
(:mod:`rlcore.controller.rollout_producer`); a batch older than ``max_trajectory_age_steps``
policy versions is dropped (counted), and the algorithm's off-policy correction uses the
generator's own logprobs. Refit waits for the generator to be between batches (a lock), and,
until the last step, for the rollout thread to have begun the next batch's generation: otherwise a
producer slow to reach the lock (one that waits for the interpreter lock while the trainer's
thread launches kernels) generates after every refit, and "one step off" trains on fresh
batches with no overlap at all (seen on an H200: 82% of a 200-step run's batches).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from rlcore.controller.batching import (
    DataCursor, Trajectory, apply_env_steps, is_correct, rollout_metrics, sampling_params, score, to_sequence_batch,
)
from rlcore.controller.checkpoint import (
    CheckpointManager, resume_loggers, rng_state, run_catching_sigterm, set_rng_state, stop_after_step,
)
from rlcore.controller.deadlines import GenerationTimeout, call_with_timeout
from rlcore.controller.interpreter import CollectorPolicy, GCClock, LockLagProbe
from rlcore.controller.refit_probe import compare_probe_logprobs, refit_probe_sequences
from rlcore.controller.rollout_producer import RolloutProducer
from rlcore.controller.run_dir import check_owner, checkpoint_root, fingerprint
from rlcore.controller.timing import StepTimer
from rlcore.interfaces import (
    Algorithm, Environment, EnvStep, Generator, MetricLogger, PromptDataset, SequenceBatch, Teacher, TrainerHandle, WeightTransport,
)

if TYPE_CHECKING:
    from rlcore.config import RunConfig
    from rlcore.controller.report import Reporter
    from rlcore.rollout import MultiTurnRunner


class NonFiniteLossError(RuntimeError):
    """Too many non-finite losses in a row."""


@attrs.define
class GeneratedRound:
    """One round of rollouts, generated and not yet scored."""

    trajectories: list[Trajectory]
    version: int  # the generator's weights version they were sampled with
    final_steps: list | None  # multi-turn: the EnvSteps each rollout ended with (scored already)
    began: float  # time.perf_counter() when the generation took the generator
    env_metrics: dict = attrs.field(factory=dict)  # the environment's, once scored


@attrs.define
class Components:
    """What one run is made of; each part is reached only through its protocol."""

    config: RunConfig
    trainer: TrainerHandle
    generator: Generator
    environment: Environment
    algorithm: Algorithm
    dataset: PromptDataset
    transport: WeightTransport
    loggers: list[MetricLogger]
    reporter: Reporter
    multi_turn: MultiTurnRunner | None = None  # rollouts of multi-turn environments
    run_identity: dict | None = None  # RunDir.identity(): run id, log dir, fingerprint (checkpoints record it)
    teacher: Teacher | None = None  # scores rollouts for algorithms registered with a teacher (distillation)


class GRPOLoop:
    def __init__(self, c: Components):
        self.c = c
        cfg = c.config
        self.grpo = cfg.grpo
        self.generation_cfg = cfg.generation
        self.refit_cfg = self.generation_cfg.refit
        self.cursor = DataCursor(len(c.dataset.train), cfg.grpo.seed)
        self.step = 0
        self.policy_version = 0
        self.nonfinite_in_a_row = 0
        self.records: list[dict] = []
        self.gen_lock = threading.Lock()
        # The environment is not assumed thread-safe: async scoring and the trainer's validation share it.
        self.score_lock = threading.Lock()
        self._producer: RolloutProducer | None = None  # async: the rollout and scoring threads
        self.ckpt = CheckpointManager(checkpoint_root(cfg), cfg.checkpointing.keep_last_k) if cfg.checkpointing.enabled else None
        self.identity = c.run_identity or {"run_id": "", "log_dir": cfg.logger.log_dir, "fingerprint": fingerprint(cfg)}
        # ``time/elapsed_s`` of each record: wall seconds since the run began, counted across resumes
        # (a resumed run starts from its checkpoint's last record), so curves against wall time join up.
        self.started = time.perf_counter()
        self.elapsed_before = 0.0
        self.saved_step = -1
        # SIGTERM (a scheduler's preemption, a job's time limit) ends the run after the current
        # step, with a checkpoint of that step when checkpointing is on: nothing done is lost.
        self.stop_signal: int | None = None
        # the garbage collector's pauses and the interpreter lock's waits, recorded with each step (interpreter.py)
        self.collector = CollectorPolicy(cfg.cluster.gc_freeze_setup, cfg.cluster.manual_gc)
        self.gc_clock, self.lock_lag = GCClock(), LockLagProbe(cfg.cluster.gil_lag_probe)

    # ---- rollouts ---------------------------------------------------------------------------
    def _generate(self, samples, n: int, seed: int | None, greedy: bool = False):
        """Results per sample, the weights version, for multi-turn environments the EnvSteps the rollouts
        ended with (else None), and the ``time.perf_counter()`` at which the generation took the generator."""
        params = sampling_params(self.generation_cfg, n, seed, greedy)
        final_steps = None
        producer = self._producer if self._producer is not None and threading.current_thread() is self._producer.thread else None
        with self.gen_lock:
            began = time.perf_counter()
            version = self.c.generator.weights_version
            if producer is not None:
                producer.generation_began()
            if self.c.multi_turn is not None:
                results = self._bounded(lambda: self.c.multi_turn(samples, params), "multi-turn rollouts")
                final_steps = [[EnvStep(reward=t.reward, metrics=t.env_metrics) for t in group]
                               for group in self.c.multi_turn.last_trajectories]
            else:
                results = self._bounded(lambda: self.c.generator.generate([s.prompt_ids for s in samples], params), "generate")
            if producer is not None:
                producer.generation_ended()
        return results, version, final_steps, began

    def _bounded(self, fn, what: str):
        limit = self.c.config.cluster.timeout_s
        return call_with_timeout(fn, limit, lambda: f"timeout: the generator's '{what}' did not finish within {limit:g}s "
                                                    f"(cluster.timeout_s) at step {self.step}", GenerationTimeout)

    def _score(self, trajs: list[Trajectory], final_steps) -> dict[str, float]:
        """Multi-turn rollouts were scored turn by turn already; single-turn ones are scored now."""
        if final_steps is None:
            with self.score_lock:
                return score(self.c.environment, trajs)
        return apply_env_steps(trajs, [step for group in final_steps for step in group])

    def _rollout_group(self, step: int, round_: int) -> GeneratedRound:
        G = self.grpo.num_generations_per_prompt
        samples = [self.c.dataset.train[i] for i in self.cursor.take(self.grpo.num_prompts_per_step)]
        seed = (self.grpo.seed * 1_000_003 + step * 101 + round_) if self.grpo.deterministic else None
        results, version, final_steps, began = self._generate(samples, G, seed)
        first_group = round_ * len(samples)  # unique group ids across refill rounds
        trajectories = [Trajectory(s, first_group + g, r) for g, (s, rs) in enumerate(zip(samples, results)) for r in rs]
        return GeneratedRound(trajectories, version, final_steps, began)

    def refill_rounds(self) -> int:
        """DAPO-style refill rounds the algorithm may ask for after dropping groups (0: none)."""
        return int(getattr(self.c.algorithm, "max_refill_rounds", 0) or 0)

    def generate_round(self, step: int, round_: int, timer: StepTimer) -> GeneratedRound:
        with timer.phase("generation"):
            return self._rollout_group(step, round_)

    def generator_metrics(self) -> dict[str, float]:
        generator_metrics = getattr(self.c.generator, "metrics", None)
        return {k: float(v) for k, v in generator_metrics().items()} if callable(generator_metrics) else {}

    def collect(self, step: int, timer: StepTimer) -> tuple[list[Trajectory], dict, int]:
        """Trajectories for one step, with DAPO-style refill when the algorithm drops groups."""
        rounds = self.refill_rounds()
        target = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        generated: list[GeneratedRound] = []
        for round_ in range(rounds + 1):
            generated.append(self.generate_round(step, round_, timer))
            kept, metrics, version = self.finish_collect(generated, timer, score_last_only=True)
            if len(kept) >= target or rounds == 0:
                break
        metrics.update(self.generator_metrics())
        return kept, metrics, version

    def finish_collect(self, rounds: list[GeneratedRound], timer: StepTimer,
                       score_last_only: bool = False) -> tuple[list[Trajectory], dict, int]:
        """Score ``rounds`` (only the last when the earlier ones were scored already) and keep whole
        groups: the step's trajectories, its rollout metrics (from the first round) and weights version."""
        for generated in rounds[-1:] if score_last_only else rounds:
            with timer.phase("reward"):
                generated.env_metrics = self._score(generated.trajectories, generated.final_steps)
        metrics: dict[str, float] = {**rounds[0].env_metrics, **rollout_metrics(rounds[0].trajectories)}
        kept: list[Trajectory] = []
        for generated in rounds:
            trajs = generated.trajectories
            rewards_N, groups_N, truncated_N = self._reward_tensors(trajs)
            # Whole groups are kept or dropped here (dynamic sampling); single trajectories the
            # algorithm filters (overlong) stay in their group's baseline and are masked in train_on.
            keep_N = self.c.algorithm.keep_trajectories(rewards_N, groups_N, truncated_N)
            kept_groups = set(groups_N[keep_N].tolist())
            kept.extend(t for t in trajs if t.group in kept_groups)
        metrics["rollout/refill_rounds"] = float(len(rounds) - 1)
        kept = kept[: self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt]
        metrics["rollout/kept_trajectories"] = float(len(kept))
        return kept, metrics, rounds[-1].version

    def _reward_tensors(self, trajs: list[Trajectory]):
        rewards_N = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        groups_N = torch.tensor([t.group for t in trajs], dtype=torch.long)
        truncated_N = torch.tensor([t.truncated for t in trajs], dtype=torch.bool)
        return rewards_N, groups_N, truncated_N

    # ---- one step ---------------------------------------------------------------------------
    def train_on(self, trajectories: list[Trajectory], timer: StepTimer) -> tuple[dict, SequenceBatch | None]:
        algorithm, trainer = self.c.algorithm, self.c.trainer
        if not trajectories:
            return {"train/skipped_empty": 1.0}, None
        rewards_N, groups_N, truncated_N = self._reward_tensors(trajectories)
        lengths_N = torch.tensor([len(t.result.response_ids) for t in trajectories])
        shaped_N = algorithm.shape_rewards(rewards_N, lengths_N, truncated_N)
        advantages_N = algorithm.advantages(shaped_N, groups_N)
        batch = to_sequence_batch(trajectories, advantages_N, self.c.config.policy.max_total_sequence_length)
        keep_N = algorithm.keep_trajectories(rewards_N, groups_N, truncated_N)
        for i in torch.nonzero(~keep_N).flatten().tolist():
            batch.loss_mask[i] = torch.zeros_like(batch.loss_mask[i])
        with timer.phase("logprobs"):
            if algorithm.uses_old_logprobs:
                batch.token_fields["old_logprobs"] = trainer.logprobs(batch, what="'logprobs' (policy)")
            if algorithm.uses_reference:
                batch.token_fields["ref_logprobs"] = trainer.logprobs(batch, reference=True, what="'logprobs' (reference)")
            if self.c.teacher is not None:
                batch.token_fields["teacher_logprobs"] = self.c.teacher.logprobs(batch)
        with timer.phase("training"):
            out = trainer.train(batch, algorithm)
        self.collector.after_training()
        metrics = {f"train/{k}": float(v) for k, v in out.items()}
        if out.get("skipped_nonfinite"):
            self.nonfinite_in_a_row += 1
            warnings.warn(f"step {self.step}: non-finite loss, update skipped ({self.nonfinite_in_a_row} in a row)")
            if self.nonfinite_in_a_row >= self.grpo.max_consecutive_nonfinite:
                raise NonFiniteLossError(
                    f"{self.nonfinite_in_a_row} non-finite losses in a row (grpo.max_consecutive_nonfinite); stopping"
                )
        else:
            self.nonfinite_in_a_row = 0
            self.policy_version += 1
        return metrics, batch

    def refit(self, probe_batch: SequenceBatch | None, timer: StepTimer, generator_free=None) -> dict:
        """Weights to the generator, then the probe; ``generator_free()`` is called once the generator
        is no longer needed (async: the rollout thread may start the next batch while the trainer compares)."""
        # The probe's generator pass shares the transfer's hold of the lock. Released in between, the
        # rollout thread waiting for it (async) could take it first and generate a whole batch, and the
        # probe, and with it the trainer's next step, would wait for all of it.
        with timer.phase("refit"), self.gen_lock:
            held_from = time.perf_counter()
            ended = self._producer.last_generation_end if self._producer is not None else None
            moved = self.c.transport.transfer(self.c.trainer, self.c.generator)
            probed = self._probe_generator(probe_batch) if probe_batch is not None else None
            held_s = time.perf_counter() - held_from
        if generator_free is not None:
            generator_free()
        metrics = {"refit/seconds": float(moved.get("seconds", 0.0)), "refit/bytes": float(moved.get("bytes", 0.0)),
                   "refit/generator_hold_s": held_s}  # the generator's time taken by transfer and probe
        if ended is not None:  # async: from the end of the generation the refit waited for to its hold
            metrics["async/refit_after_generation_s"] = held_from - ended
        if metrics["refit/seconds"] > 0:
            metrics["refit/gb_per_s"] = metrics["refit/bytes"] / metrics["refit/seconds"] / 1e9
        if probed is not None:
            with timer.phase("refit"):
                metrics.update(self._compare_probe(*probed))
        return metrics

    def _probe_generator(self, batch: SequenceBatch) -> tuple[SequenceBatch, list] | None:
        """The probe's sequences and the generator's logprobs of them (the caller holds ``gen_lock``)."""
        count = self.refit_cfg.probe_num_sequences
        if count <= 0:
            return None
        probe = refit_probe_sequences(batch, count, self.c.config.policy.max_total_sequence_length)  # scorable at the limit
        return probe, self.c.generator.score([ids.tolist() for ids in probe.input_ids])

    def _compare_probe(self, probe: SequenceBatch, gen_lp: list) -> dict:
        train_lp = self.c.trainer.logprobs(probe, what="'logprobs' (refit probe)")
        return compare_probe_logprobs(probe, gen_lp, train_lp, self.refit_cfg.probe_threshold, self.step)

    def validate(self) -> dict:
        val = self.c.dataset.validation
        if not val:
            return {}
        samples = list(val[: self.grpo.max_val_samples])
        results, _, final_steps, _ = self._generate(samples, 1, self.grpo.seed, greedy=True)
        trajs = [Trajectory(s, i, rs[0]) for i, (s, rs) in enumerate(zip(samples, results))]
        self._score(trajs, final_steps)
        metrics = {
            "val/accuracy": float(np.mean([is_correct(t.reward, t.env_metrics) for t in trajs])),
            "val/reward_mean": float(np.mean([t.reward for t in trajs])),
        }
        if self.c.teacher is not None:
            metrics["val/reverse_kl"] = self.held_out_reverse_kl(samples)
        return metrics

    def held_out_reverse_kl(self, samples) -> float:
        """Mean over response tokens of log p_policy - log p_teacher on one seeded sample per prompt
        (y ~ p: the k1 estimate of the per-token reverse KL, the quantity distillation lowers)."""
        results, _, _, _ = self._generate(samples, 1, self.grpo.seed)
        trajs = [Trajectory(s, i, rs[0]) for i, (s, rs) in enumerate(zip(samples, results))]
        batch = to_sequence_batch(trajs, torch.zeros(len(trajs)), self.c.config.policy.max_total_sequence_length)
        policy = self.c.trainer.logprobs(batch, what="'logprobs' (validation)")
        teacher = self.c.teacher.logprobs(batch)
        diff = sum(float(((p - t) * m)[1:].sum()) for p, t, m in zip(policy, teacher, batch.loss_mask))
        tokens = sum(float(m[1:].sum()) for m in batch.loss_mask)
        return diff / max(tokens, 1.0)

    # ---- checkpoints ------------------------------------------------------------------------
    def maybe_resume(self) -> None:
        if self.ckpt is None or not self.c.config.checkpointing.resume:
            return
        found = self.ckpt.resume(
            lambda path, state: check_owner(state.get("run"), self.identity, path),
            lambda path: self.c.trainer.load_checkpoint(str(path)),
        )
        if found is None:
            return
        latest, state = found
        self.step, self.policy_version = state["step"], state["policy_version"]
        self.cursor.position, self.records = state["data_position"], state["records"]
        self.started = time.perf_counter()
        self.elapsed_before = self.records[-1].get("time/elapsed_s", 0.0) if self.records else 0.0
        self.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        set_rng_state(state["rng"])
        self.c.transport.transfer(self.c.trainer, self.c.generator)
        resume_loggers(self.c.loggers, self.step, self.records)  # steps after the checkpoint are redone; missing ones restored
        print(f"resumed from {latest} at step {self.step}")

    def save(self) -> None:
        state = {
            "step": self.step, "policy_version": self.policy_version, "data_position": self.cursor.position,
            "records": self.records, "nonfinite_in_a_row": self.nonfinite_in_a_row, "rng": rng_state(),
            "run": self.identity,
        }
        with self._training_state_on_device():
            self.ckpt.save(self.step, self.c.trainer.save_checkpoint, state)
        self.saved_step = self.step

    @contextlib.contextmanager
    def _training_state_on_device(self):
        """A checkpoint reads the optimizer state where the backend keeps it while training: with
        ``offload_trainer_state`` the engines sleep while it comes back for the save (saves come
        after the refit, with the engines awake and the state on the host)."""
        if not self.generation_cfg.colocated.offload_trainer_state:
            yield
            return
        self.c.generator.sleep()
        self._move_training_state(out=False)  # timed within the step's "checkpoint" phase
        try:
            yield
        finally:
            self._move_training_state(out=True)
            self.c.generator.wake_up()

    def stop_requested(self) -> bool:
        """After a step: whether SIGTERM arrived; if so, checkpoint this step (unless just done)."""
        return stop_after_step(self, checkpoint_root(self.c.config))

    # ---- driver -----------------------------------------------------------------------------
    def finish_step(self, record: dict, timer: StepTimer) -> None:
        if self.grpo.val_period and self.step % self.grpo.val_period == 0:
            with timer.phase("validation"):
                record.update(self.validate())
        record.update(timer.finish())
        record.update(self.gc_clock.take())
        record.update(self.lock_lag.take())
        record["step"] = self.step
        record["policy_version"] = self.policy_version
        self.records.append(record)
        record["time/elapsed_s"] = self.elapsed()  # before saving, so that a resumed run counts on from it
        if self.ckpt is not None and self.step % self.c.config.checkpointing.save_period == 0:
            # Saved after the record joins the list, so a resumed run's summary has this step too
            # (its saved timing lacks only the checkpoint's own time).
            with timer.phase("checkpoint"):
                self.save()
            record.update(timer.finish())
        record["time/elapsed_s"] = self.elapsed()
        for logger in self.c.loggers:
            logger.log({k: v for k, v in record.items() if k != "step"}, self.step)
        self.c.reporter.step(record, self.step)

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def run(self) -> list[dict]:
        with self.collector, self.gc_clock, self.lock_lag:
            return run_catching_sigterm(self, self._run)

    def _run(self) -> list[dict]:
        self.maybe_resume()
        if self.grpo.val_at_start and self.step == 0:
            start = self.validate()
            if start:
                start["time/elapsed_s"] = self.elapsed()
                self.records.append({"step": 0, **start})
                for logger in self.c.loggers:
                    logger.log(start, 0)
        if self.grpo.async_grpo.enabled:
            return self._run_async()
        while self.step < self.grpo.max_num_steps:
            self.step += 1
            self._set_trainer_step()
            timer = StepTimer()
            trajectories, record, _ = self.collect(self.step, timer)
            # Colocated engines release their memory while the trainer works (a no-op on CPU).
            with timer.phase("generation"):
                self.c.generator.sleep()
            self._move_training_state(out=False, timer=timer)
            metrics, batch = self.train_on(trajectories, timer)
            self._move_training_state(out=True, timer=timer)
            with timer.phase("refit"):
                self.c.generator.wake_up()
            record.update(metrics)
            record.update(self.refit(batch, timer))
            self.finish_step(record, timer)
            if self.stop_requested():
                break
        return self.records

    def _move_training_state(self, out: bool, timer: StepTimer | None = None) -> None:
        """``policy.generation.colocated.offload_trainer_state``: the trainer's optimizer state and
        gradients leave the GPU before the engines wake, and come back before the trainer works;
        ``timer`` counts it as the step's "offload" phase."""
        if self.generation_cfg.colocated.offload_trainer_state:
            with timer.phase("offload") if timer is not None else contextlib.nullcontext():
                if out:
                    self.c.trainer.offload(keep_weights=True)  # the refit that follows reads them on the GPU
                else:
                    self.c.trainer.onload()

    def _set_trainer_step(self) -> None:
        self.c.trainer.loop_step = self.step
        if hasattr(self.c.environment, "current_step"):  # TimedEnvironment names the step of a hung call
            self.c.environment.current_step = self.step

    def _run_async(self) -> list[dict]:
        max_age = self.grpo.async_grpo.max_trajectory_age_steps
        producer = RolloutProducer(self, self.step, self.c.config.cluster.timeout_s, max_age)
        self._producer = producer
        producer.start()
        dropped = 0
        try:
            while self.step < self.grpo.max_num_steps:
                # The step's time counts from here: a step that waits for its batch takes that long too.
                waiting_since = time.perf_counter()
                produced = producer.next_batch()
                age = self.policy_version - produced.version
                if age > max_age:
                    dropped += 1
                    producer.batch_done()
                    continue
                self.step += 1
                self._set_trainer_step()
                timer = StepTimer()
                timer.start = waiting_since
                timer.phases.update(produced.timer.phases)
                record = produced.metrics
                record.update({"async/trajectory_age": float(age), "async/dropped_stale_batches": float(dropped),
                               "async/batch_wait_s": time.perf_counter() - waiting_since})
                metrics, batch = self.train_on(produced.trajectories, timer)
                record.update(metrics)
                if self.step < self.grpo.max_num_steps:
                    with timer.phase("refit"):
                        producer.await_generation_after(produced.generations_before, self.step)
                # A validation step's held-out pass takes the generator before the next batch does.
                validates = bool(self.grpo.val_period) and self.step % self.grpo.val_period == 0
                record.update(self.refit(batch, timer, generator_free=None if validates else producer.batch_done))
                self.finish_step(record, timer)
                if validates:
                    producer.batch_done()
                if self.stop_requested():
                    break
        finally:
            producer.close()
            self._producer = None
        return self.records
