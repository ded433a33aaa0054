"""The SFT loop: supervised fine-tuning on a dataset's reference answers.

``rlcore.run`` comes here when the recipe's algorithm is registered with ``trains_on="answers"``
(``sft``). An example is its prompt ids followed by the tokens of its reference response
(``Sample.response``; when the dataset gives none, ``str(Sample.answer)``) and EOS, trained on the
response and EOS tokens only (:func:`answer_batch`). Each step's examples go to the configured
training backend (fsdp2 or Megatron) through :class:`~rlcore.interfaces.TrainerHandle`: packed
micro-batches (``policy.sequence_packing``), ``policy.train_global_batch_size`` per optimizer step,
the loss normalized by the step's valid tokens (:mod:`rlcore.algorithms.sft`).

Validation (``train.val_period``, ``train.val_at_start``, the first ``train.max_val_samples``
held-out examples): ``val/loss``, the token-mean negative log-likelihood of the held-out answers
(the backend's logprobs); with a ``policy.generation`` section also ``val/accuracy``: the
generator, refitted with the trainer's weights, decodes the held-out prompts greedily and the
environment scores them, as the GRPO loop's validation and ``rlcore eval`` do.

Steps, records, checkpoints, resume and SIGTERM are the offline loop's
(:mod:`rlcore.controller.offline`); the trained model is written to ``<logger.log_dir>/model`` as a
Hugging Face checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlcore.config import ConfigError, RunConfig
from rlcore.generation.batching import Trajectory, is_correct, sampling_params, score
from rlcore.controller.engines import build_engines
from rlcore.controller.environment import build_environment
from rlcore.controller.task import build_algorithm, given_or_built_dataset, given_or_loaded_tokenizer
from rlcore.controller.offline import BackendPolicy, OfflineSteps, run_offline
from rlcore.controller.placement import plan_placement
from rlcore.controller.transport import pick_transport
from rlcore.controller.model_files import check_model_name
from rlcore.controller.preflight import check_prompt_lengths, check_step_sizes
from rlcore.controller.run_dir import RunDir
from rlcore.controller.run_skeleton import trains_on
from rlcore.controller.rollouts import image_generator
from rlcore.interfaces import (
    ClosableEnvironment,
    Environment,
    Generator,
    Sample,
    SamplingParams,
    SequenceBatch,
    TrainerHandle,
    WeightTransport,
)
from rlcore.plugins import get_plugin_manager


def trains_on_answers(config: RunConfig) -> bool:
    return trains_on(config) == "answers"


def answer_batch(samples: Sequence[Sample], tokenizer: Any, max_length: int | None = None) -> tuple[SequenceBatch, int]:
    """Prompt + reference response + EOS for each sample, trained on the response and EOS tokens
    only; sequences over ``max_length`` tokens are cut there. Returns the batch and how many were cut."""
    ids, masks, cut = [], [], 0
    for sample in samples:
        text = sample.response if sample.response is not None else str(sample.answer)
        response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        prompt = list(sample.prompt_ids)
        if max_length is not None and len(prompt) + len(response) > max_length:
            response, cut = response[: max(0, max_length - len(prompt))], cut + 1
        ids.append(torch.tensor(prompt + response))
        masks.append(torch.tensor([0.0] * len(prompt) + [1.0] * len(response)))
    images = [s.images for s in samples]
    return SequenceBatch(input_ids=ids, loss_mask=masks, images=images if any(i is not None for i in images) else None), cut


def greedy_accuracy(generator: Generator, environment: Environment, samples: Sequence[Sample], params: SamplingParams) -> float:
    """Fraction of ``samples`` whose decoded response (``params``: greedy) the environment scores correct."""
    if any(s.images is not None for s in samples):
        results = image_generator(generator).generate_with_images([s.prompt_ids for s in samples], [s.images for s in samples], params)
    else:
        results = generator.generate([s.prompt_ids for s in samples], params)
    trajs = [Trajectory(s, i, r[0]) for i, (s, r) in enumerate(zip(samples, results))]
    score(environment, trajs)
    return float(np.mean([is_correct(t.reward, t.env_metrics) for t in trajs]))


class SFTTrainer(BackendPolicy):
    """The policy trained on reference answers through a training backend; held-out loss and accuracy."""

    def __init__(self, config: RunConfig, trainer: TrainerHandle, algorithm: Any, tokenizer: Any,
                 generator: Generator | None = None, environment: Environment | None = None,
                 transport: WeightTransport | None = None):
        self.config, self.trainer, self.algorithm, self.tokenizer = config, trainer, algorithm, tokenizer
        self.generator, self.environment, self.transport = generator, environment, transport
        self.max_length = config.policy.max_total_sequence_length
        if generator is not None:
            generator.sleep()  # a colocated engine gives its memory back to training between validations (CPU: a no-op)

    def train_answers(self, samples: Sequence[Sample]) -> dict[str, float]:
        batch, cut = answer_batch(samples, self.tokenizer, self.max_length)
        metrics = {f"train/{k}": float(v) for k, v in self.trainer.train(batch, self.algorithm).items()}
        metrics["train/truncated_sequences"] = float(cut)
        metrics["train/response_tokens"] = float(sum(float(m.sum()) for m in batch.loss_mask))
        return metrics

    def evaluate(self, samples: Sequence[Sample]) -> dict[str, float]:
        batch, _ = answer_batch(samples, self.tokenizer, self.max_length)
        logprobs = self.trainer.logprobs(batch, what="'logprobs' (validation)")
        nll = sum(-float((lp.double() * m.double()).sum()) for lp, m in zip(logprobs, batch.loss_mask))
        tokens = sum(float(m.sum()) for m in batch.loss_mask)
        metrics = {"val/loss": nll / max(tokens, 1.0)}
        if self.generator is not None:
            self.generator.wake_up()
            self.transport.transfer(self.trainer, self.generator)
            params = sampling_params(self.config.generation, 1, self.config.train.seed, greedy=True)
            metrics["val/accuracy"] = greedy_accuracy(self.generator, self.environment, samples, params)
            self.generator.sleep()
        return metrics

    def save(self, path: str) -> None:
        super().save(path)
        self.tokenizer.save_pretrained(path)

    def shutdown(self) -> None:
        super().shutdown()
        if self.generator is not None:
            self.generator.shutdown()
        if isinstance(self.environment, ClosableEnvironment):
            self.environment.close()


def build_sft_run(config: RunConfig, given: dict) -> tuple[SFTTrainer, Any]:
    """The trainer (and, with ``policy.generation``, generator and environment) and the dataset."""
    manager = get_plugin_manager()
    if given.get("tokenizer") is None or given.get("backend") is None:
        check_model_name(config)
    tokenizer = given_or_loaded_tokenizer(config, given)
    if tokenizer.eos_token_id is None:
        raise ConfigError("policy.tokenizer_name", "the tokenizer has no EOS token to end the reference responses with")
    algorithm = given.get("algorithm") or build_algorithm(config, manager)
    dataset = given_or_built_dataset(config, manager, given, tokenizer)
    if not dataset.train or not isinstance(dataset.train[0], Sample):
        raise ConfigError("data.name", f"algorithm '{algorithm.name}' trains on prompts with reference answers "
                          "(rlcore.interfaces.Sample); this dataset does not provide them")
    check_prompt_lengths(dataset, config)
    check_step_sizes(config, dataset)
    placement = plan_placement(config)
    generates = given.get("generator") is not None or config.section("policy.generation") is not None
    engines = build_engines(config, manager, placement, given, algorithm, generate=generates)
    trainer, generator = engines.trainer, engines.generator
    environment = transport = None
    if generates:
        environment, _ = build_environment(config, manager, given)
        transport = pick_transport(manager, trainer, generator, config)
    return SFTTrainer(config, trainer, algorithm, tokenizer, generator, environment, transport), dataset


def run_sft(config: RunConfig, owner: RunDir, run_dir: Path, given: dict) -> dict:
    """The SFT run in ``run_dir`` (opened by ``rlcore.run``); returns summary and records."""
    trainer, dataset = build_sft_run(config, given)
    steps = OfflineSteps(train=trainer.train_answers, evaluate=trainer.evaluate, save_checkpoint=trainer.save_checkpoint,
                         load_checkpoint=trainer.load_checkpoint, shown=("train/loss", "val/loss", "val/accuracy"))
    return run_offline(config, owner, run_dir, given, trainer, steps, dataset.train, dataset.validation, "sft",
                       ("val/loss_first", "val/loss_last"))
