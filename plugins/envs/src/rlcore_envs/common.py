"""What this plugin's datasets and environments share: encoding both splits, importing an ecosystem
package, replaying histories in sessions."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from rlcore.interfaces import EnvStep, Sample
from rlcore.data.prompts import PromptSplits, tokenize_split


def build_splits(train: list[Sample], validation: list[Sample], tokenizer: Any, keys: Any) -> PromptSplits:
    """Both splits encoded (chat template or plain text, as ``keys.chat_template`` says), prompts
    over ``keys.max_prompt_tokens`` dropped and counted."""
    stats: dict[str, int] = {}
    encode = functools.partial(tokenize_split, tokenizer=tokenizer, max_prompt_tokens=keys.max_prompt_tokens, stats=stats,
                               chat_template=keys.chat_template)
    val = encode(validation, split="validation") if validation else None
    return PromptSplits(train=encode(train, split="train"), validation=val, stats=stats)


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
