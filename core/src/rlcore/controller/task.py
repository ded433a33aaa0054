"""The task of a run: what it learns and from what: the algorithm (its ``auto`` keys decided), the
tokenizer and the prompt data, from the recipe (through the plugin registry) or from the objects a
user passes to ``rlcore.run``.

The environment that scores is built in :mod:`rlcore.controller.environment`, the parts that hold the
policy's weights in :mod:`rlcore.controller.engines`.
"""

from __future__ import annotations

from typing import Any

from rlcore.config import RunConfig
from rlcore.data.rows import is_rows, rows_dataset
from rlcore.interfaces import OldLogprobsChoice


def one_update_per_batch(config: RunConfig) -> bool:
    """Each generated batch trains exactly one optimizer step (``policy.train_global_batch_size``
    unset or at least P*G, the most a step keeps). The loop takes old logprobs right before the
    update, from the weights it starts at, so they are then the current policy's, detached, up to
    numerics. That holds in async runs too: a batch generated one version back is still scored by
    the trainer's weights of the moment (the generator's staleness is the rollout correction's part,
    p_train / p_gen)."""
    size, per_step = config.policy.train_global_batch_size, config.train.num_prompts_per_step * config.grpo.num_generations_per_prompt
    return size is None or size >= per_step


def resolve_old_logprobs(config: RunConfig, algorithm: Any) -> Any:
    """``algorithm`` with its old-logprob pass decided for this run, built from the recipe or
    passed to ``rlcore.run`` alike: one implementing :class:`rlcore.interfaces.OldLogprobsChoice`
    (``use_old_logprobs: auto``) skips the pass when :func:`one_update_per_batch`; any
    other keeps the ``uses_old_logprobs`` it declares."""
    if not isinstance(algorithm, OldLogprobsChoice):
        return algorithm
    one_update = one_update_per_batch(config)
    use = algorithm.choose_old_logprobs(one_update)
    why = "one optimizer step per batch" if one_update else "several optimizer steps per batch"
    print(f"algorithm {algorithm.name}: old-logprob pass {'runs' if use else 'skipped'} ({why}; "
          "algorithm.use_old_logprobs: auto|true|false)", flush=True)
    return algorithm


def build_algorithm(config: RunConfig, manager, registration=None):
    """The recipe's algorithm (``algorithm.name``, or ``registration``) built from its section, ``auto`` keys decided."""
    section = config.require_section("algorithm")
    return resolve_old_logprobs(config, (registration or manager.get("algorithm", section.name)).build(section))


def given_or_loaded_tokenizer(config: RunConfig, given: dict) -> Any:
    """The tokenizer passed to ``rlcore.run``, else ``policy.tokenizer_name`` (or the model's) through transformers."""
    tokenizer = given.get("tokenizer")
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.policy.tokenizer_name or config.policy.model_name)
    return tokenizer


def given_or_built_dataset(config: RunConfig, manager, given: dict, tokenizer: Any) -> Any:
    """The dataset passed to ``rlcore.run``, else the ``data`` section's plugin built with ``tokenizer``."""
    dataset = given.get("dataset")
    if dataset is None:
        data_cfg = config.require_section("data")
        dataset = manager.get("dataset", data_cfg.name).build(data_cfg, tokenizer)
    elif is_rows(dataset):  # TRL's train_dataset: rows with a "prompt" column
        dataset = rows_dataset(dataset, tokenizer)
    return dataset
