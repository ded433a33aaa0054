"""Prompt datasets: the train/validation splits a dataset factory returns, and prompt encoding.

Every text dataset (rlcore-math's files and arithmetic, rlcore-envs' verifiers, OpenEnv,
reasoning-gym and code tasks) builds its samples' conversations, then encodes them here: the
tokenizer's chat template with the generation prompt (or the plain text), prompts over
``data.max_prompt_tokens`` dropped, counted and said.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from rlcore.errors import DataError
from rlcore.interfaces import GenerationResult, Sample

log = logging.getLogger("rlcore.data.prompts")
_BATCH = 1024  # conversations per apply_chat_template call


@attrs.define
class PromptSplits:
    """A :class:`rlcore.interfaces.PromptDataset`: ``train`` and ``validation`` samples
    (``prompt_ids`` filled) and what loading counted (``<split>/dropped_too_long``, ...)."""

    train: list[Sample]
    validation: list[Sample] | None
    stats: dict[str, int] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self.train)

    def __getitem__(self, index: int) -> Sample:
        return self.train[index]


def messages_for(user: str, system: str | None) -> list[dict[str, str]]:
    """A one-turn conversation: the system prompt (when given), then the user's message."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def encode_conversations(tokenizer: Any, conversations: list[list[dict[str, str]]],
                         chat_template: bool = True) -> list[list[int]]:
    """Prompt token ids: the tokenizer's chat template with the generation prompt, or the plain text.

    One ``apply_chat_template`` call over many conversations renders each and tokenizes them all
    in one batched call: the same ids as one call per conversation, several times faster.
    """
    if not conversations:
        return []
    if not chat_template:
        texts = ["".join(m["content"] for m in conv) for conv in conversations]
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {type(tokenizer).__name__} has no chat template; set data.chat_template=false "
                        "where the dataset allows it, or use a tokenizer with one")
    out = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(out, "keys"):  # some tokenizers still answer a BatchEncoding
        out = out["input_ids"]
    return [[int(t) for t in ids] for ids in out]


def tokenize_split(samples: Sequence[Sample], tokenizer: Any, split: str, max_prompt_tokens: int | None,
                   stats: dict[str, int], chat_template: bool = True, error: type[DataError] = DataError) -> list[Sample]:
    """Fill ``prompt_ids`` and ``index``; drop (and count in ``stats``, and say so) prompts over
    ``max_prompt_tokens``. A split whose every prompt is too long raises ``error``."""
    kept: list[Sample] = []
    longest = 0
    conversations = [s.prompt if isinstance(s.prompt, list) else messages_for(s.prompt, None) for s in samples]
    all_ids: list[list[int]] = []
    for first in range(0, len(conversations), _BATCH):
        all_ids += encode_conversations(tokenizer, conversations[first : first + _BATCH], chat_template)
    for sample, ids in zip(samples, all_ids):
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            longest = max(longest, len(ids))
            continue
        sample.prompt_ids = ids
        sample.index = len(kept)
        kept.append(sample)
    dropped = len(samples) - len(kept)
    stats[f"{split}/dropped_too_long"] = dropped
    if dropped:
        log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_tokens=%s (longest %d tokens); "
                    "raise the limit or shorten data.prompt_template", split, dropped, len(samples), max_prompt_tokens, longest)
    if samples and not kept:
        raise error(f"{split}: every one of {len(samples)} prompts is longer than data.max_prompt_tokens={max_prompt_tokens} "
                    f"(longest {longest} tokens)")
    return kept


def fit_to_context(prompt_ids: Sequence[int], max_model_len: int, overflow: str) -> tuple[list[int] | None, str | None]:
    """A prompt as an engine of ``max_model_len`` tokens takes it (room for one new token at least), and what was
    done: ``(ids, None)`` as it is, ``(last ids, "truncated")`` (the chat template's generation prompt is at the
    end), or ``(None, "dropped")``, by ``policy.generation.prompt_overflow`` (``truncate`` or ``drop``). A
    generator counts the outcome as ``generation/<outcome>_prompts`` and answers a dropped prompt with
    :meth:`rlcore.interfaces.GenerationResult.dropped`."""
    limit = max_model_len - 1
    if len(prompt_ids) <= limit:
        return list(prompt_ids), None
    if overflow == "drop":
        return None, "dropped"
    return list(prompt_ids[-limit:]), "truncated"


def answers_in_order(prompts: Sequence[Sequence[int]], fitted: Sequence[list[int] | None], n: int, version: int,
                     answer: Callable[[list[int]], list[GenerationResult]]) -> list[list[GenerationResult]]:
    """A generator's ``n`` results for each prompt, in order: ``answer(fitted prompt)`` for one the engine took (called
    in prompt order, so it may read the engine's outputs in sequence), ``n`` empty ones for a dropped one."""
    return [[GenerationResult.dropped(list(orig), version) for _ in range(n)] if ids is None else answer(ids)
            for orig, ids in zip(prompts, fitted)]
