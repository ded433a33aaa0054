"""Rows as a dataset: ``rlcore.run(config, dataset=rows, reward_fn=fn)``, as TRL's ``train_dataset``.

``rows`` is a Hugging Face ``datasets.Dataset`` (or anything with ``column_names`` whose items are
dicts), a ``DatasetDict`` (its ``train`` split, and ``validation`` or else ``test`` for the held-out
evaluation), or a list of dicts. Each row needs a ``prompt``: text, used as it is (TRL's standard
format), or chat messages (``[{"role": "user", "content": ...}]``, TRL's conversational format),
rendered with the tokenizer's chat template and its generation prompt. An ``answer`` column is the
environment's ground truth; a ``completion`` text column is the reference response ``sft`` trains
on; every other column reaches a reward function as a keyword list, as in TRL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlcore.interfaces import Sample
from rlcore.data.prompts import PromptSplits, tokenize_split

HELD_OUT_SPLITS = ("validation", "test")


def is_rows(obj: Any) -> bool:
    """Whether ``obj`` is rows (a datasets.Dataset or DatasetDict, a list of dicts), not an rlcore dataset."""
    if hasattr(obj, "train") and hasattr(obj, "validation"):  # an rlcore PromptDataset
        return False
    if hasattr(obj, "column_names"):
        return True
    return isinstance(obj, Sequence) and not isinstance(obj, str) and bool(obj) and isinstance(obj[0], Mapping)


def _splits(rows: Any) -> tuple[Any, Any]:
    if isinstance(rows, Mapping):  # a DatasetDict
        if "train" not in rows:
            raise TypeError(f"rlcore.run(dataset=...): the DatasetDict has no 'train' split (it has {sorted(rows)})")
        return rows["train"], next((rows[s] for s in HELD_OUT_SPLITS if s in rows), None)
    return rows, None


def check_rows(rows: Any) -> None:
    """Raise TypeError (before any model loads) when the rows have no ``prompt`` column."""
    for name, split in zip(("train", "held-out"), _splits(rows)):
        if split is None:
            continue
        columns = list(split.column_names) if hasattr(split, "column_names") else sorted({k for r in split for k in r})
        if "prompt" not in columns:
            raise TypeError(f"rlcore.run(dataset=...): the {name} rows have no 'prompt' column (they have {columns}); "
                            "give each row a 'prompt': text, or chat messages [{'role': 'user', 'content': ...}]")


def _sample(row: Mapping[str, Any]) -> Sample:
    others = {k: v for k, v in row.items() if k not in ("prompt", "answer", "completion")}
    completion = row.get("completion")
    return Sample(prompt=row["prompt"], answer=row.get("answer"), metadata=others,
                  response=completion if isinstance(completion, str) else None)


def rows_dataset(rows: Any, tokenizer: Any) -> PromptSplits:
    """The rows' samples, their prompts tokenized (text as it is, messages through the chat template)."""
    check_rows(rows)
    train, held_out = _splits(rows)
    stats: dict[str, int] = {}
    out = []
    for name, split in (("train", train), ("validation", held_out)):
        samples = [_sample(row) for row in split] if split is not None else []
        chat = bool(samples) and isinstance(samples[0].prompt, list)
        out.append(tokenize_split(samples, tokenizer, name, None, stats, chat_template=chat) if samples else None)
    if not out[0]:
        raise TypeError("rlcore.run(dataset=...): the training rows are empty")
    return PromptSplits(train=out[0], validation=out[1], stats=stats)
