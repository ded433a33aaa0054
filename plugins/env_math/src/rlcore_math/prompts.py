"""What every dataset of this plugin shares: the dataset object, chat-template encoding, length limits."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs

from rlcore.interfaces import Sample

log = logging.getLogger("rlcore_math")


class DataError(ValueError):
    """A data file is unusable; the message names the file, the line or row, and the column."""


@attrs.define
class MathDataset:
    """``train`` and ``validation`` samples (``prompt_ids`` filled) and what loading counted."""

    train: list[Sample]
    validation: list[Sample] | None
    stats: dict[str, int] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self.train)

    def __getitem__(self, index: int) -> Sample:
        return self.train[index]


def messages_for(user: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}]


def encode(tokenizer: Any, messages: list[dict[str, str]], chat_template: bool = True) -> list[int]:
    """Prompt token ids: the tokenizer's chat template with the generation prompt, or the plain text."""
    if not chat_template:
        return list(tokenizer.encode("".join(m["content"] for m in messages), add_special_tokens=False))
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {type(tokenizer).__name__} has no chat template; set data.chat_template=false "
                        "where the dataset allows it, or use a tokenizer with one")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):  # some tokenizers still answer a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def tokenize_split(samples: Sequence[Sample], tokenizer: Any, split: str, max_prompt_tokens: int | None,
                   stats: dict[str, int], chat_template: bool = True) -> list[Sample]:
    """Fill ``prompt_ids`` and ``index``; drop (and count, and say so) prompts over the limit."""
    kept: list[Sample] = []
    longest = 0
    for sample in samples:
        ids = encode(tokenizer, sample.prompt if isinstance(sample.prompt, list) else messages_for(sample.prompt, None),
                     chat_template)
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
        raise DataError(f"{split}: every one of {len(samples)} prompts is longer than data.max_prompt_tokens={max_prompt_tokens} "
                        f"(longest {longest} tokens)")
    return kept
