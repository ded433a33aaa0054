"""What every dataset of this plugin shares: the dataset object and prompt encoding."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs

from rlcore.errors import DataError
from rlcore.interfaces import EnvStep, Sample

log = logging.getLogger("rlcore_envs")


@attrs.define
class EnvDataset:
    """``train`` and ``validation`` samples (``prompt_ids`` filled) and what loading counted."""

    train: list[Sample]
    validation: list[Sample] | None
    stats: dict[str, int] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self.train)

    def __getitem__(self, index: int) -> Sample:
        return self.train[index]


def messages_for(user: str, system: str | None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def encode(samples: Sequence[Sample], tokenizer: Any, split: str, keys: Any, stats: dict[str, int]) -> list[Sample]:
    """Fill ``prompt_ids`` and ``index`` (chat template or plain text, as ``keys.chat_template`` says);
    drop and count prompts over ``keys.max_prompt_tokens``."""
    conversations = [s.prompt if isinstance(s.prompt, list) else messages_for(s.prompt, None) for s in samples]
    if not conversations:
        return []
    if keys.chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"tokenizer {type(tokenizer).__name__} has no chat template; set data.chat_template=false")
        ids = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(["".join(m["content"] for m in c) for c in conversations], add_special_tokens=False)["input_ids"]
    kept = []
    for sample, prompt_ids in zip(samples, ids):
        if keys.max_prompt_tokens is not None and len(prompt_ids) > keys.max_prompt_tokens:
            continue
        sample.prompt_ids = [int(t) for t in prompt_ids]
        sample.index = len(kept)
        kept.append(sample)
    stats[f"{split}/dropped_too_long"] = len(samples) - len(kept)
    if len(kept) < len(samples):
        log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_tokens=%s", split, len(samples) - len(kept),
                    len(samples), keys.max_prompt_tokens)
    if not kept:
        raise DataError(f"{split}: every one of {len(samples)} prompts is longer than data.max_prompt_tokens={keys.max_prompt_tokens}")
    return kept


def build_splits(train: list[Sample], validation: list[Sample], tokenizer: Any, keys: Any) -> EnvDataset:
    stats: dict[str, int] = {}
    val = encode(validation, tokenizer, "validation", keys, stats) if validation else None
    return EnvDataset(train=encode(train, tokenizer, "train", keys, stats), validation=val, stats=stats)


def require(module: str, extra: str):
    """Import an ecosystem package, or fail naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{module} is not installed: pip install 'rlcore-envs[{extra}]' ({exc})") from exc


def replay_in_sessions(environment: Any, samples: Sequence[Sample], histories: Sequence[list[str]]) -> list[EnvStep]:
    """``step(samples, histories)`` of a session environment: each whole history replayed, turn by turn, in a
    fresh session of its own (closed after), until the environment says done; an empty history sends one
    empty turn."""
    steps = []
    for sample, history in zip(samples, histories):
        session = environment.open_session(sample)
        try:
            step = EnvStep(reward=0.0, done=True)
            for turn in history or [""]:
                step = session.step(turn)
                if step.done:
                    break
        finally:
            session.close()
        steps.append(step)
    return steps
