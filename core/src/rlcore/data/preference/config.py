"""Schema of the ``preference`` dataset (section ``data``, ``name: preference``). Imports no torch."""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config.structure import doc


@frozen(kw_only=True)
class PreferenceDataConfig:
    """Preference pairs from local files: each row has ``chosen`` and ``rejected`` (text or a list
    of chat messages) and, unless the responses are whole conversations, ``prompt``."""

    name: Literal["preference"] = field(default="preference", metadata=doc("selects this dataset"))
    train_files: tuple[str, ...] = field(metadata=doc("JSONL (.jsonl/.json) or Parquet (.parquet) files of pairs"))
    validation_files: tuple[str, ...] = field(default=(), metadata=doc("held-out pairs; empty = hold out num_validation rows"))
    num_validation: int = field(default=0, validator=attrs.validators.ge(0),
                                metadata=doc("rows of train_files held out (seeded) when validation_files is empty"))
    prompt_column: str = field(default="prompt", metadata=doc("column of the prompt (text or messages)"))
    chosen_column: str = field(default="chosen", metadata=doc("column of the preferred response"))
    rejected_column: str = field(default="rejected", metadata=doc("column of the other response"))
    format: Literal["auto", "json", "parquet"] = field(default="auto", metadata=doc("file format; auto = by extension"))
    max_row_bytes: int = field(default=1 << 20, validator=attrs.validators.gt(0),
                               metadata=doc("a row (a JSONL line, a .json or .parquet row) longer than this is an error naming the file and row, found before parsing"))
    seed: int = field(default=0, metadata=doc("seed of the held-out split"))

    def __attrs_post_init__(self) -> None:
        if not self.train_files:
            raise ValueError("train_files is empty: name at least one JSONL or Parquet file of preference pairs")
