"""The pairwise loop: DPO and reward-model training on preference pairs.

``rlcore.run`` comes here when the recipe's algorithm is registered with ``trains_on="pairs"``
(``dpo``, ``reward_model``). Each step draws ``grpo.num_prompts_per_step`` pairs (seeded,
epoch-wise order), trains the algorithm's :class:`~rlcore.interfaces.PairTrainer` on them,
and every ``grpo.val_period`` steps (and at the start with ``grpo.val_at_start``) evaluates the
held-out pairs (at most ``grpo.max_val_samples``). Records go to the enabled loggers
(``metrics.jsonl``) and ``summary.json``; the trained model is written to
``<logger.log_dir>/model`` as a Hugging Face checkpoint. No generator or environment is built.

The trainer comes from the algorithm's ``pair_trainer`` capability, a ``"module:attr"`` factory
``(config, algorithm, tokenizer) -> PairTrainer``: :func:`policy_pair_trainer` here trains the
policy through the configured training backend (fsdp2 or Megatron).
Not yet: checkpoints and resume of this loop (``checkpointing`` is ignored here).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlcore.config import ConfigError, RunConfig
from rlcore.controller.batching import DataCursor
from rlcore.controller.placement import plan_placement
from rlcore.controller.preflight import check_model_name
from rlcore.controller.run_dir import RunDir
from rlcore.interfaces import PairTrainer, PreferenceDataset, PreferencePair, TrainerHandle
from rlcore.plugins import get_plugin_manager
from rlcore.utils import resolve


def trains_on_pairs(config: RunConfig) -> bool:
    section = config.section("algorithm")
    if section is None:
        return False
    return get_plugin_manager().get("algorithm", section.name).capabilities.get("trains_on") == "pairs"


class PolicyPairTrainer:
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

    def save(self, path: str) -> None:
        self.trainer.run_on_ranks("rlcore.controller.pairs:export_hf_on_rank", path, what="export_hf")

    def shutdown(self) -> None:
        self.trainer.shutdown()


def export_hf_on_rank(backend: Any, rank: int, world_size: int, path: str) -> None:
    backend.export_hf(path)  # a collective: every rank takes part, rank 0 writes


def policy_pair_trainer(config: RunConfig, algorithm: Any, tokenizer: Any) -> PolicyPairTrainer:
    from rlcore.controller.run import build_trainer

    manager = get_plugin_manager()
    trainer = build_trainer(config, manager, plan_placement(config))
    return PolicyPairTrainer(trainer, algorithm, config.policy.max_total_sequence_length)


def _loggers(config: RunConfig, run_dir: Path) -> list:
    manager, loggers = get_plugin_manager(), []
    for reg in manager.registry["logger"].values():
        section = config.section(reg.section)
        if section is not None and section.enabled:
            loggers.append(reg.build(section, run_dir))
    return loggers


def build_pair_run(config: RunConfig, given: dict) -> tuple[PairTrainer, PreferenceDataset]:
    manager = get_plugin_manager()
    if given.get("pair_trainer") is None or given.get("tokenizer") is None:
        check_model_name(config)
    tokenizer = given.get("tokenizer")
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.policy.tokenizer_name or config.policy.model_name)
    algorithm_reg = manager.get("algorithm", config.section("algorithm").name)
    algorithm = given.get("algorithm") or algorithm_reg.build(config.section("algorithm"))
    dataset = given.get("dataset")
    if dataset is None:
        data_cfg = config.require_section("data")
        dataset = manager.get("dataset", data_cfg.name).build(data_cfg, tokenizer)
    if not dataset.train or not isinstance(dataset.train[0], PreferencePair):
        raise ConfigError("data.name", f"algorithm '{algorithm.name}' trains on preference pairs; dataset "
                          f"'{config.section('data').name}' does not provide them (use data.name: preference)")
    trainer = given.get("pair_trainer")
    if trainer is None:
        trainer = resolve(algorithm_reg.capabilities["pair_trainer"])(config, algorithm, tokenizer)
    return trainer, dataset


def run_pairs(config: RunConfig, owner: RunDir, run_dir: Path, given: dict) -> dict:
    """The pairwise run in ``run_dir`` (opened by ``rlcore.run``); returns summary and records."""
    trainer, dataset = build_pair_run(config, given)
    loop = config.grpo
    loggers = given.get("loggers")
    if loggers is None:
        loggers = _loggers(config, run_dir)
    validation = list(dataset.validation or [])[: loop.max_val_samples]
    cursor = DataCursor(len(dataset.train), loop.seed)
    records: list[dict] = []
    started = time.perf_counter()
    try:
        if loop.val_at_start and validation:
            records.append({"step": 0, **trainer.evaluate(validation)})
            _emit(records[-1], loggers, owner)
        for step in range(1, loop.max_num_steps + 1):
            t0 = time.perf_counter()
            record = trainer.train_pairs([dataset.train[i] for i in cursor.take(loop.num_prompts_per_step)])
            record["timing/training"] = time.perf_counter() - t0
            if validation and loop.val_period and step % loop.val_period == 0:
                record.update(trainer.evaluate(validation))
            record["step"] = step
            records.append(record)
            _emit(record, loggers, owner)
        trainer.save(str(run_dir / "model"))
    finally:
        for logger in loggers:
            logger.close()
        trainer.shutdown()
    vals = [r for r in records if "val/accuracy" in r]
    summary = {"steps": loop.max_num_steps, "run_id": owner.run_id, "seconds": time.perf_counter() - started,
               "val/accuracy_first": vals[0]["val/accuracy"] if vals else None,
               "val/accuracy_last": vals[-1]["val/accuracy"] if vals else None,
               "val/reward_margin_first": vals[0].get("val/reward_margin") if vals else None,
               "val/reward_margin_last": vals[-1].get("val/reward_margin") if vals else None}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return {"summary": summary, "records": records, "run_dir": str(run_dir), "model_dir": str(run_dir / "model")}


def _emit(record: dict, loggers: list, owner: RunDir) -> None:
    for logger in loggers:
        logger.log({k: v for k, v in record.items() if k != "step"}, record["step"])
    shown = {k: record[k] for k in ("train/loss", "train/accuracy", "val/accuracy", "val/reward_margin") if k in record}
    print(f"step {record['step']:4d}  " + "  ".join(f"{k} {v:.4f}" for k, v in shown.items()), flush=True)
