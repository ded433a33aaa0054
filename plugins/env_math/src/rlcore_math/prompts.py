"""What every dataset of this plugin shares: its data error, and core's prompt encoding
(:mod:`rlcore.data.prompts`) raising it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from rlcore.errors import DataError as CoreDataError
from rlcore.interfaces import Sample
from rlcore.data.prompts import tokenize_split as _tokenize_split

log = logging.getLogger("rlcore_math")


class DataError(CoreDataError):
    """A data file is unusable; the message names the file, the line or row, and the column.
    (``rlcore run`` reports it as one message, exit status 2.)"""


def tokenize_split(samples: Sequence[Sample], tokenizer: Any, split: str, max_prompt_tokens: int | None,
                   stats: dict[str, int], chat_template: bool = True) -> list[Sample]:
    """:func:`rlcore.data.prompts.tokenize_split`, a split of only too-long prompts raising this plugin's DataError."""
    return _tokenize_split(samples, tokenizer, split, max_prompt_tokens, stats, chat_template, error=DataError)
