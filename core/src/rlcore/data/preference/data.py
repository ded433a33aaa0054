"""The ``preference`` dataset: local JSONL or Parquet files of pairs, read through ``datasets``.

A row is one of (``prompt`` / ``chosen`` / ``rejected`` being the configured columns):

- text: ``{"prompt": "2+2=", "chosen": "4", "rejected": "5"}``; ids are the tokenized prompt
  followed by the tokenized response and EOS;
- messages: ``{"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}], ...}``
  (a text prompt becomes one user message, a text response one assistant message); ids come from
  the tokenizer's chat template, and the response is what the template adds after the prompt
  with its generation prompt;
- whole conversations without ``prompt``: ``chosen`` and ``rejected`` are message lists that
  differ only in their last (assistant) message, the shared part being the prompt.

Every row is checked when the dataset is built; a bad one stops loading with a
:class:`PreferenceDataError` naming the file, the row and what is wrong.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import attrs

from rlcore.errors import DataError
from rlcore.interfaces import PreferencePair
from rlcore.data.preference.config import PreferenceDataConfig
from rlcore.data.row_limits import check_rows, text_problem


class PreferenceDataError(DataError):
    """A preference file or row that cannot be used; the message names the file and row."""


@attrs.define
class PreferenceData:
    train: list[PreferencePair]
    validation: list[PreferencePair] | None


def build_preference_dataset(config: PreferenceDataConfig, tokenizer: Any) -> PreferenceData:
    train = [pair for path in config.train_files for pair in load_pairs(path, config, tokenizer)]
    if config.validation_files:
        validation = [pair for path in config.validation_files for pair in load_pairs(path, config, tokenizer)]
    elif config.num_validation:
        if config.num_validation >= len(train):
            raise PreferenceDataError(f"data.num_validation={config.num_validation} leaves no training pairs "
                                      f"(the train files have {len(train)})")
        held_out = set(random.Random(config.seed).sample(range(len(train)), config.num_validation))
        validation = [p for i, p in enumerate(train) if i in held_out]
        train = [p for i, p in enumerate(train) if i not in held_out]
    else:
        validation = None
    return PreferenceData(train=train, validation=validation)


def _read_rows(path: str, config: PreferenceDataConfig) -> list[dict]:
    import datasets

    from rlcore.loading.shipped import shipped_data_file

    file = shipped_data_file(path) or Path(path)  # a shipped recipe's data, run outside a checkout
    if not file.is_file():
        raise PreferenceDataError(f"{path}: no such file (data.train_files / data.validation_files)")
    kind = config.format
    if kind == "auto":
        suffix = file.suffix.lower()
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
        if kind is None:
            raise PreferenceDataError(f"{path}: cannot tell the format from '{suffix}'; use .jsonl, .json or .parquet, "
                                      "or set data.format")
    suffix = file.suffix.lower()
    check_rows(file, config.max_row_bytes, "data.max_row_bytes",
               "parquet" if kind == "parquet" else "json" if suffix == ".json" else "jsonl")
    try:
        table = datasets.load_dataset(kind, data_files=str(file), split="train")
    except Exception as err:  # datasets wraps parser errors in its own types
        raise PreferenceDataError(f"{path}: could not be read as {kind}: {err}") from err
    return list(table)


def load_pairs(path: str, config: PreferenceDataConfig, tokenizer: Any) -> list[PreferencePair]:
    rows = _read_rows(path, config)
    if not rows:
        raise PreferenceDataError(f"{path}: no rows")
    return [_pair(row, f"{path}: row {i}", config, tokenizer) for i, row in enumerate(rows)]


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _check_value(value: Any, column: str, where: str) -> None:
    problem = text_problem(value)
    if problem:
        raise PreferenceDataError(f"{where}: '{column}' {problem}")
    if isinstance(value, str):
        if not value and column != "prompt":
            raise PreferenceDataError(f"{where}: '{column}' is empty")
        return
    if not _is_messages(value) or not value:
        raise PreferenceDataError(f"{where}: '{column}' must be text or a non-empty list of "
                                  f"{{'role', 'content'}} messages, got {type(value).__name__}: {str(value)[:80]!r}")


def _pair(row: dict, where: str, config: PreferenceDataConfig, tokenizer: Any) -> PreferencePair:
    cols = {"chosen": config.chosen_column, "rejected": config.rejected_column}
    for column in cols.values():
        if row.get(column) is None:
            raise PreferenceDataError(f"{where}: missing '{column}' (columns: {sorted(k for k, v in row.items() if v is not None)})")
    chosen, rejected = row[cols["chosen"]], row[cols["rejected"]]
    prompt = row.get(config.prompt_column)
    _check_value(chosen, config.chosen_column, where)
    _check_value(rejected, config.rejected_column, where)
    if prompt is None:
        prompt, chosen, rejected = _split_conversations(chosen, rejected, where)
    else:
        _check_value(prompt, config.prompt_column, where)
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        prompt_ids = list(tokenizer(prompt)["input_ids"]) if prompt else []
        response = [_text_ids(tokenizer, text, where) for text in (chosen, rejected)]
    else:
        prompt_msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        prompt_ids = _template(tokenizer, prompt_msgs, where, add_generation_prompt=True)
        response = [_response_ids(tokenizer, prompt_msgs, prompt_ids, value, column, where)
                    for value, column in ((chosen, cols["chosen"]), (rejected, cols["rejected"]))]
    return PreferencePair(prompt_ids=prompt_ids, chosen_ids=response[0], rejected_ids=response[1], source=where)


def _split_conversations(chosen: Any, rejected: Any, where: str):
    if not (_is_messages(chosen) and _is_messages(rejected)):
        raise PreferenceDataError(f"{where}: no 'prompt', so 'chosen' and 'rejected' must be whole conversations (messages)")
    if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
        raise PreferenceDataError(f"{where}: without 'prompt', 'chosen' and 'rejected' must share every message but the last")
    return chosen[:-1], chosen[-1:], rejected[-1:]


def _text_ids(tokenizer: Any, text: str, where: str) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise PreferenceDataError(f"{where}: the tokenizer has no EOS token to end a text response with")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


def _template(tokenizer: Any, messages: list[dict], where: str, add_generation_prompt: bool) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise PreferenceDataError(f"{where}: messages need a chat template, and the tokenizer has none")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


def _response_ids(tokenizer: Any, prompt_msgs: list[dict], prompt_ids: list[int], value: Any, column: str,
                  where: str) -> list[int]:
    messages = [{"role": "assistant", "content": value}] if isinstance(value, str) else list(value)
    full = _template(tokenizer, prompt_msgs + messages, where, add_generation_prompt=False)
    if full[: len(prompt_ids)] != prompt_ids:
        raise PreferenceDataError(f"{where}: the chat template of prompt + '{column}' does not start with the prompt's "
                                  "tokens, so the response cannot be cut out of it")
    if len(full) == len(prompt_ids):
        raise PreferenceDataError(f"{where}: '{column}' adds no tokens after the prompt")
    return full[len(prompt_ids):]
