"""The pairwise loop: DPO and reward-model training on preference pairs.

``rlcore.run`` comes here when the recipe's algorithm is registered with ``trains_on="pairs"``
(``dpo``, ``reward_model``). Each step draws ``train.num_prompts_per_step`` pairs (seeded,
epoch-wise order), trains the algorithm's :class:`~rlcore.interfaces.PairTrainer` on them,
and every ``train.val_period`` steps (and at the start with ``train.val_at_start``) evaluates the
held-out pairs (at most ``train.max_val_samples``). Records go to the enabled loggers
(``metrics.jsonl``) and ``summary.json``; the trained model is written to
``<logger.log_dir>/model`` as a Hugging Face checkpoint. No generator or environment is built.

The trainer comes from the algorithm's ``pair_trainer`` capability, a ``"module:attr"`` factory
``(config, algorithm, tokenizer) -> PairTrainer``: :func:`policy_pair_trainer` here trains the
policy through the configured training backend (fsdp2 or Megatron).
The steps, validation, checkpoints and resume (SIGTERM included) are the offline loop's
(:mod:`rlcore.controller.offline`), with the GRPO loop's semantics.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlcore.config import ConfigError, RunConfig
from rlcore.controller.engines import build_trainer
from rlcore.controller.task import given_or_built_dataset, given_or_loaded_tokenizer
from rlcore.controller.heartbeat import doing
from rlcore.controller.offline import BackendPolicy, OfflineSteps, run_offline
from rlcore.controller.placement import plan_placement
from rlcore.controller.model_files import check_model_name
from rlcore.controller.preflight import check_pairs, check_step_sizes
from rlcore.controller.run_dir import RunDir
from rlcore.controller.run_skeleton import trains_on
from rlcore.interfaces import PairTrainer, PreferenceDataset, PreferencePair, TrainerHandle
from rlcore.plugins import get_plugin_manager
from rlcore.utils import resolve


def trains_on_pairs(config: RunConfig) -> bool:
    return trains_on(config) == "pairs"


class PolicyPairTrainer(BackendPolicy):
    """DPO through a training backend: reference logprobs once per batch, then ``trainer.train``."""

    def __init__(self, trainer: TrainerHandle, algorithm: Any, max_length: int):
        self.trainer, self.algorithm, self.max_length = trainer, algorithm, max_length

    def _batch(self, pairs: Sequence[PreferencePair]):
        from rlcore.algorithms.pairs import pair_batch

        return pair_batch(list(pairs), self.max_length)

    def train_pairs(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        batch = self._batch(pairs)
        if self.algorithm.uses_reference:
            batch.token_fields["ref_logprobs"] = self.trainer.logprobs(batch, reference=True, what="'logprobs' (reference)")
        return {f"train/{k}": float(v) for k, v in self.trainer.train(batch, self.algorithm).items()}

    def evaluate(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        """Held-out DPO margins: h = beta * (log-ratio of chosen - log-ratio of rejected), per pair."""
        from rlcore.algorithms.pairs import response_logprob_sums

        batch = self._batch(pairs)
        policy_n = response_logprob_sums(self.trainer.logprobs(batch, what="'logprobs' (validation)"), batch)
        ref_n = (response_logprob_sums(self.trainer.logprobs(batch, reference=True, what="'logprobs' (validation reference)"), batch)
                 if self.algorithm.uses_reference else torch.zeros_like(policy_n))
        ratio_n = policy_n - ref_n
        margin_p = self.algorithm.config.beta * (ratio_n[0::2] - ratio_n[1::2])
        return {"val/reward_margin": float(margin_p.mean()), "val/accuracy": float((margin_p > 0).double().mean()),
                "val/chosen_logprob": float(policy_n[0::2].mean()), "val/rejected_logprob": float(policy_n[1::2].mean())}



def policy_pair_trainer(config: RunConfig, algorithm: Any, tokenizer: Any) -> PolicyPairTrainer:
    manager = get_plugin_manager()
    doing("loading the model into the training backend")
    trainer = build_trainer(config, manager, plan_placement(config))
    return PolicyPairTrainer(trainer, algorithm, config.policy.max_total_sequence_length)


def build_pair_run(config: RunConfig, given: dict) -> tuple[PairTrainer, PreferenceDataset]:
    manager = get_plugin_manager()
    check_model_name(config)  # the pair trainer is always built from policy.model_name
    tokenizer = given_or_loaded_tokenizer(config, given)
    algorithm_reg = manager.get("algorithm", config.section("algorithm").name)
    algorithm = given.get("algorithm") or algorithm_reg.build(config.section("algorithm"))
    dataset = given_or_built_dataset(config, manager, given, tokenizer)
    if not dataset.train or not isinstance(dataset.train[0], PreferencePair):
        raise ConfigError("data.name", f"algorithm '{algorithm.name}' trains on preference pairs; dataset "
                          f"'{config.section('data').name}' does not provide them (use data.name: preference)")
    check_pairs(dataset, config)
    check_step_sizes(config, dataset)
    return resolve(algorithm_reg.capabilities["pair_trainer"])(config, algorithm, tokenizer), dataset


def run_pairs(config: RunConfig, owner: RunDir, run_dir: Path, given: dict) -> dict:
    """The pairwise run in ``run_dir`` (opened by ``rlcore.run``); returns summary and records."""
    trainer, dataset = build_pair_run(config, given)
    steps = OfflineSteps(train=trainer.train_pairs, evaluate=trainer.evaluate, save_checkpoint=trainer.save_checkpoint,
                         load_checkpoint=trainer.load_checkpoint,
                         shown=("train/loss", "train/accuracy", "val/accuracy", "val/reward_margin"))
    return run_offline(config, owner, run_dir, given, trainer, steps, dataset.train, dataset.validation, "pairs",
                       ("val/reward_margin_first", "val/reward_margin_last"))
