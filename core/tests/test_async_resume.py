"""Async GRPO resumes from its checkpoints: a resumed run trains on where it left off, and its
checkpoints never skip the prompts of batches in flight. The run loop and the async driver are
real; trainer, generator and environment are plain fakes (no model), so the test takes seconds.

- A resumed run's generator starts again at its first weights version while the policy's version
  is restored: batches must still be judged by the policy version they were sampled from (a run
  that compared the two counters dropped every batch as stale, forever).
- A checkpoint's data position is that of the last batch trained on: the rollout thread has drawn
  the prompts of one or two more batches by then, and a resumed run generates those again.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import torch

import rlcore
from rlcore.algorithms.grpo import GRPO
from rlcore.controller.async_driver import run_async
from rlcore.controller.checkpoint import CheckpointManager
from rlcore.controller.loop import Components, GRPOLoop
from rlcore.controller.report import Reporter
from rlcore.interfaces import EnvStep, GenerationResult, Sample

P, G = 2, 2


class Trainer:
    """Records the prompts of every batch it trains on; its checkpoint is a file."""

    loop_step = 0

    def __init__(self, trained: list[list[int]]):
        self.trained = trained

    def logprobs(self, batch, *, reference=False, what=""):
        return [torch.zeros(len(ids)) for ids in batch.input_ids]

    def train(self, batch, algorithm):
        self.trained.append(sorted({int(ids[0]) for ids in batch.input_ids}))
        return {"loss": 0.0}

    def save_checkpoint(self, path):
        open(path, "w").close()

    def load_checkpoint(self, path):
        assert open(path).read() == ""


class Generator:
    """Each response is one token; a weights version per refit, from 0 in every new process."""

    def __init__(self):
        self.weights_version, self.calls = 0, 0

    def generate(self, prompts, params):
        self.calls += 1
        if self.calls > 40:  # far more batches than the run's steps: every batch is being dropped
            raise RuntimeError("the generator was asked for 40 batches")
        return [[GenerationResult(prompt_ids=list(p), response_ids=[7], response_logprobs=[-0.5], finish_reason="stop")
                 for _ in range(params.n)] for p in prompts]

    def score(self, sequences):
        return [[0.0] * len(s) for s in sequences]

    def sleep(self):
        pass

    def wake_up(self):
        pass


class Transport:
    name = "fake"

    def transfer(self, trainer, generator):
        generator.weights_version += 1
        return {}


class Environment:
    def step(self, samples, responses):  # rewards differ within each group, so no group is all-equal
        return [EnvStep(reward=float(i % 2)) for i in range(len(samples))]


def run(tmp_path, steps: int, trained: list[list[int]]) -> GRPOLoop:
    config = rlcore.build_config({
        "policy": {"model_name": "unused", "max_total_sequence_length": 16,
                   "generation": {"backend": "hf", "max_new_tokens": 1}},
        "algorithm": {"name": "grpo"}, "data": {"name": "arithmetic"}, "env": {"name": "math"},
        "train": {"num_prompts_per_step": P, "max_num_steps": steps, "seed": 3},
        "grpo": {"num_generations_per_prompt": G, "async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}},
        "cluster": {"timeout_s": 20},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(tmp_path / "ckpt"), "save_period": 1, "keep_last_k": 10},
        "logger": {"log_dir": str(tmp_path / "run"), "print_table": False, "plot": False},
    })
    dataset = SimpleNamespace(train=[Sample(prompt=f"p{i}", prompt_ids=[100 + i]) for i in range(64)], validation=None)
    loop = GRPOLoop(Components(config, Trainer(trained), Generator(), Environment(), GRPO(), dataset, Transport(), [],
                               Reporter(steps, enabled=False)))
    loop.run(run_async)
    return loop


def drawn(count: int) -> list[int]:
    """The first ``count`` prompt ids in the run's data order."""
    from rlcore.generation.batching import DataCursor

    return [100 + i for i in DataCursor(64, seed=3).take(count)]


def test_async_resume_from_step_3_trains_on(tmp_path):
    trained: list[list[int]] = []
    first = run(tmp_path, steps=3, trained=trained)
    assert first.step == 3 and len(trained) == 3
    resumed = run(tmp_path, steps=6, trained=trained)  # a new generator: its weights version starts at 0 again
    assert resumed.step == 6 and len(trained) == 6
    ages = [r["async/trajectory_age"] for r in resumed.records if r["step"] > 3]
    assert ages == [0.0, 1.0, 1.0] and all(r["async/dropped_stale_batches"] == 0 for r in resumed.records if r["step"] > 3)


def test_async_checkpoints_keep_the_prompts_in_flight(tmp_path):
    trained: list[list[int]] = []
    run(tmp_path, steps=4, trained=trained)
    ckpt = CheckpointManager(tmp_path / "ckpt", 10)
    assert [ckpt.load_loop_state(path)["data_position"] for _, path in ckpt.complete()] == [2, 4, 6, 8]
    # killed after step 2: the resumed run trains each prompt of the uninterrupted order once
    for _, path in ckpt.complete()[2:]:
        shutil.rmtree(path)
    (tmp_path / "run" / "metrics.jsonl").unlink(missing_ok=True)
    resumed: list[list[int]] = []
    run(tmp_path, steps=4, trained=resumed)
    order = drawn(4 * P)
    assert trained[:2] + resumed == [sorted(order[i:i + P]) for i in range(0, 4 * P, P)]

