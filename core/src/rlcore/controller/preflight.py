"""Checks made when a run's parts are built, before the first step: what would otherwise fail
later, deep inside a library, without naming the key or the row at fault. The model's files are
checked before anything loads them (:mod:`rlcore.controller.model_files`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from rlcore.controller.checks import check_packing
from rlcore.config import ConfigError, RunConfig
from rlcore.interfaces import plugin_name

log = logging.getLogger("rlcore")
_NAMED_ROWS = 3  # over-long prompts named in the message; the rest are counted


def check_prompt_lengths(dataset: Any, config: RunConfig) -> dict[str, int]:
    """Drop (``policy.overlong_prompts: drop``, counted and the first rows named) or refuse
    (``error``) prompts that leave no room for a response within ``policy.max_total_sequence_length``.
    Returns counts by split."""
    limit = config.policy.max_total_sequence_length
    counts = {}
    for split, samples in _splits(dataset).items():
        if not samples:
            continue
        long = [s for s in samples if s.prompt_ids is not None and len(s.prompt_ids) >= limit]
        counts[split] = len(long)
        if not long:
            continue
        named = "; ".join(_where(s) for s in long[:_NAMED_ROWS]) + (f"; and {len(long) - _NAMED_ROWS} more" if len(long) > _NAMED_ROWS else "")
        what = (f"{split}: {len(long)} of {len(samples)} prompts have at least policy.max_total_sequence_length={limit} "
                f"tokens, leaving no room for a response ({named})")
        if config.policy.overlong_prompts == "error" or len(long) == len(samples):
            raise ConfigError("policy.max_total_sequence_length", f"{what}; raise the limit, shorten the prompts"
                              + (", or set policy.overlong_prompts=drop" if len(long) < len(samples) else ""))
        kept = [s for s in samples if not (s.prompt_ids is not None and len(s.prompt_ids) >= limit)]
        for index, sample in enumerate(kept):
            sample.index = index
        try:
            setattr(dataset, split, kept)
        except (AttributeError, TypeError) as exc:
            raise ConfigError("policy.overlong_prompts", f"{what}, and the dataset {type(dataset).__name__} cannot drop them "
                              f"({exc}); shorten them or raise the limit") from None
        message = f"warning: {what}: dropped (policy.overlong_prompts=drop)"
        print(message, flush=True)
        log.warning(message)
    return counts


def _splits(dataset: Any) -> dict[str, Any]:
    """The splits of a dataset (:class:`rlcore.interfaces.PromptDataset` or ``PreferenceDataset``: both
    declare ``train`` and ``validation``), by name."""
    return {"train": dataset.train, "validation": dataset.validation}


def _where(sample: Any) -> str:
    meta = sample.metadata or {}
    place = ", ".join(str(meta[k]) for k in ("source", "location") if k in meta)
    return f"{place or f'row {sample.index}'}: {len(sample.prompt_ids)} tokens"


def check_step_sizes(config: RunConfig, dataset: Any) -> None:
    """What every loop checks once its data is read and before its model loads (GRPO's, SFT's, the
    preference pairs'): a step's examples are distinct rows of the dataset, and a micro-batch's token
    budget holds the longest sequence."""
    per_step = config.train.num_prompts_per_step
    train = dataset.train or ()
    if train and per_step > len(train):  # (an empty one is refused as the loop starts)
        raise ConfigError("train.num_prompts_per_step", f"{per_step} prompts per step, but the training "
                          f"data has {len(train)}; at most {len(train)}")
    check_packing(config)


def check_run_sizes(config: RunConfig, dataset: Any, algorithm: Any) -> None:
    """Sizes the data and the algorithm of a rollout loop must allow, checked before the first step:
    :func:`check_step_sizes`, a step's trajectories fit in host memory, and the algorithm accepts a
    group of ``grpo.num_generations_per_prompt`` (asked of the algorithm itself: a group of one has
    no spread to normalize by)."""
    check_step_memory(config)
    check_step_sizes(config, dataset)
    G = config.grpo.num_generations_per_prompt
    import copy

    import torch

    try:  # asked of a copy: an algorithm that records or counts its calls sees only the run's own
        probe = copy.deepcopy(algorithm)
    except Exception:  # noqa: BLE001 - an algorithm that cannot be copied is left to its first step
        return
    try:
        probe.advantages(torch.linspace(0.0, 1.0, G), torch.zeros(G, dtype=torch.long))
    except ValueError as exc:
        raise ConfigError("grpo.num_generations_per_prompt", f"{G} generations per prompt: algorithm "
                          f"'{plugin_name(algorithm)}' refuses such groups ({exc})") from None


# What one trajectory of a step holds in host memory at the least, whatever the backend: its
# objects and text, and per token of policy.max_total_sequence_length its ids, logprobs and mask as
# Python lists (a pointer and an object each) and then as the training batch's tensors.
_TRAJECTORY_BYTES = 1024
_TOKEN_BYTES = 64


def check_step_memory(config: RunConfig) -> None:
    """A step's P x G trajectories must fit in this machine's memory: a group size of 10^8 would
    otherwise grow until the kernel kills the run, with no message."""
    P, G = config.train.num_prompts_per_step, config.grpo.num_generations_per_prompt
    L = config.policy.max_total_sequence_length
    need = P * G * (_TRAJECTORY_BYTES + _TOKEN_BYTES * L)
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > host:
        raise ConfigError("grpo.num_generations_per_prompt", f"{G} generations for each of train.num_prompts_per_step={P} "
                          f"prompts are {P * G} trajectories a step; holding them takes at least {need / 2**30:.1f} GiB "
                          f"at policy.max_total_sequence_length={L}, more than this machine's {host / 2**30:.1f} GiB; "
                          "lower them")


def check_pairs(dataset: Any, config: RunConfig) -> dict[str, int]:
    """Preference pairs that cannot train, found before the first step: a pair whose chosen and
    rejected responses are the same tokens (no preference to learn: an error naming the pair),
    an empty response (an error), and a pair over ``policy.max_total_sequence_length`` (dropped and
    counted, the first named, or an error: ``policy.overlong_prompts``). Returns the counts dropped."""
    limit, counts = config.policy.max_total_sequence_length, {}
    for split, pairs in _splits(dataset).items():
        pairs = list(pairs or ())
        if not pairs:
            continue
        for i, pair in enumerate(pairs):
            where = pair.source or f"{split} pair {i}"
            if not pair.chosen_ids or not pair.rejected_ids:
                raise ConfigError("data", f"{where}: empty {'chosen' if not pair.chosen_ids else 'rejected'} response")
            if list(pair.chosen_ids) == list(pair.rejected_ids):
                raise ConfigError("data", f"{where}: chosen and rejected are the same response; such a pair has no "
                                  "preference to learn (remove it)")
        long = [p for p in pairs if len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) > limit]
        counts[split] = len(long)
        if not long:
            continue
        named = "; ".join(p.source or "a pair" for p in long[:_NAMED_ROWS]) + (f"; and {len(long) - _NAMED_ROWS} more" if len(long) > _NAMED_ROWS else "")
        what = (f"{split}: {len(long)} of {len(pairs)} preference pairs have prompt + response over "
                f"policy.max_total_sequence_length={limit} tokens ({named})")
        if config.policy.overlong_prompts == "error" or len(long) == len(pairs):
            raise ConfigError("policy.max_total_sequence_length", f"{what}; raise the limit or shorten them"
                              + (", or set policy.overlong_prompts=drop" if len(long) < len(pairs) else ""))
        try:
            dropped = {id(p) for p in long}
            setattr(dataset, split, [p for p in pairs if id(p) not in dropped])
        except (AttributeError, TypeError) as exc:
            raise ConfigError("policy.overlong_prompts", f"{what}, and the dataset cannot drop them ({exc})") from None
        print(f"warning: {what}: dropped (policy.overlong_prompts=drop)", flush=True)
    return counts
