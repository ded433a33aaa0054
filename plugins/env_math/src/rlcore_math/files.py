"""``math_jsonl``: math problems from local JSONL/JSON/Parquet files, ``datasets.save_to_disk``
directories (a Dataset, or a split of a DatasetDict) or a hub dataset id with a split (when the
hub, or the ``datasets`` cache, can be reached; otherwise a ConfigError naming ``data.hub_dataset``
says how to bring it), loaded through Hugging Face ``datasets``. ``prompt_column`` and
``answer_column`` map other layouts; the tokenizer's chat template is applied unless
``chat_template: false`` (base models).

Column presets:

=============  ==============  ==============================================  =========
preset         problem column  answer column                                   ground truth
=============  ==============  ==============================================  =========
``gsm8k``      ``question``    ``answer``: worked solution ending ``#### 72``  ``72``
``math``       ``problem``     ``solution``: with a final ``\\boxed{...}``      its content
``deepscaler``  ``problem``    ``answer``: the answer itself                   as is
=============  ==============  ==============================================  =========

Every row is checked before the run starts: a malformed row stops loading with a
:class:`~rlcore_math.prompts.DataError` naming the file, the line (JSONL) or row, and the
column, unless ``skip_bad_rows`` is set, in which case bad rows are skipped and counted in
``dataset.stats``. Before any parsing, JSON files are read once line by line with bounded
reads: a line over ``max_line_bytes`` (JSONL) or bytes that are not UTF-8 stop loading naming
the file and line (``decode_errors: replace`` counts such lines instead), and an empty file is
named as such.
"""

from __future__ import annotations

import codecs
import json
import random
from pathlib import Path
from typing import Any

from rlcore.config.structure import ConfigError
from rlcore.interfaces import Sample
from rlcore.errors import DataError as CoreDataError
from rlcore.runtime import check_rows, text_problem
from rlcore.data.prompts import PromptSplits, messages_for

from rlcore_math.config import MathFilesDatasetConfig
from rlcore_math.grading import hash_answer, last_boxed
from rlcore_math.prompts import DataError, log, tokenize_split

# preset -> (problem column, answer column, how the ground truth is taken from the answer column)
PRESETS: dict[str, tuple[str, str, str]] = {
    "gsm8k": ("question", "answer", "hash"),
    "math": ("problem", "solution", "boxed"),
    "deepscaler": ("problem", "answer", "verbatim"),
}


def build_math_files_dataset(config: MathFilesDatasetConfig, tokenizer: Any) -> PromptSplits:
    stats: dict[str, int] = {"bad_rows": 0}
    train = _load_sources(config, config.train_split, stats, "data.train_split")
    if config.validation_files:
        validation = _load_files(config.validation_files, config, stats, split=config.validation_split, key="data.validation_split")
    elif config.validation_split:
        validation = _load_sources(config, config.validation_split, stats, "data.validation_split")
    elif config.validation_size:
        if config.validation_size >= len(train):
            raise DataError(f"data.validation_size={config.validation_size} leaves no training rows (train has {len(train)})")
        held_out = set(random.Random(config.seed).sample(range(len(train)), config.validation_size))
        validation = [s for i, s in enumerate(train) if i in held_out]
        train = [s for i, s in enumerate(train) if i not in held_out]
    else:
        validation = None
    if config.max_samples is not None:
        train = train[: config.max_samples]
    train = tokenize_split(train, tokenizer, "train", config.max_prompt_tokens, stats, config.chat_template)
    if validation is not None:
        validation = tokenize_split(validation, tokenizer, "validation", config.max_prompt_tokens, stats, config.chat_template)
    if stats["bad_rows"]:
        log.warning("data: skipped %d malformed rows (data.skip_bad_rows=true)", stats["bad_rows"])
    if stats.get("replaced_lines"):
        log.warning("data: %d lines had bytes that are not UTF-8, replaced by U+FFFD (data.decode_errors=replace)",
                    stats["replaced_lines"])
    return PromptSplits(train=train, validation=validation, stats=stats)


def _columns(config: MathFilesDatasetConfig) -> tuple[str, str, str]:
    prompt_col, answer_col, extraction = PRESETS.get(config.preset, (None, None, "verbatim"))
    prompt_col = config.prompt_column or prompt_col
    answer_col = config.answer_column or answer_col
    if config.answer_extraction != "preset":
        extraction = config.answer_extraction
    return prompt_col, answer_col, extraction


def _load_sources(config: MathFilesDatasetConfig, split: str, stats: dict[str, int], split_key: str) -> list[Sample]:
    """``split`` of the hub dataset, or of the training files (a split matters only to saved DatasetDicts)."""
    if config.hub_dataset:
        rows = _read_hub(config, split)
        return _to_samples(rows, [f"row {i}" for i in range(len(rows))], f"{config.hub_dataset}[{split}]", config, stats)
    return _load_files(config.train_files, config, stats, split=split, key=split_key)


def _read_hub(config: MathFilesDatasetConfig, split: str) -> list[dict]:
    import datasets

    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(config.hub_dataset, config.hub_subset, split=split, cache_dir=config.cache_dir)
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, unknown split: datasets' many error types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError("data.hub_dataset", f"{config.hub_dataset!r} (subset {config.hub_subset!r}, split {split!r}) could not "
                          f"be loaded: {first}. Offline, save it where it can be reached (datasets.load_dataset(...)"
                          ".save_to_disk(DIR)) and set data.train_files=[DIR] instead") from None
    return table.to_list()


def _load_files(files: tuple[str, ...], config: MathFilesDatasetConfig, stats: dict[str, int], *, split: str | None = None,
                key: str = "data.train_split") -> list[Sample]:
    samples: list[Sample] = []
    for name in files:
        path = Path(name).expanduser()
        if path.is_dir():
            rows = _read_saved(path, split, key)
            samples.extend(_to_samples(rows, [f"row {i}" for i in range(len(rows))], path, config, stats))
            continue
        if not path.is_file():
            raise DataError(f"data file not found: {path}")
        rows, where = _read_rows(path, config, stats)
        samples.extend(_to_samples(rows, where, path, config, stats))
    if not samples:
        raise DataError(f"no usable rows in {', '.join(files)}")
    return samples


def _read_saved(path: Path, split: str | None, key: str) -> list[dict]:
    """Rows of a ``datasets.save_to_disk`` directory: a Dataset, or ``split`` of a DatasetDict."""
    import datasets

    if not any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise DataError(f"{path} is a directory but not one written by datasets.save_to_disk (no dataset_dict.json, "
                        "state.json or dataset_info.json)")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets' many error types; the directory is what matters
        raise DataError(f"{path}: cannot load with datasets.load_from_disk: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(key, f"{path} holds the splits {sorted(loaded)}, not {split!r}")
        loaded = loaded[split]
    return loaded.to_list()


def _read_rows(path: Path, config: MathFilesDatasetConfig, stats: dict[str, int]) -> tuple[list[dict], list[str]]:
    """Rows of one file and, for each, where it is ("line 12" for JSONL, "row 11" otherwise)."""
    import datasets

    suffix = path.suffix.lower()
    builder = "parquet" if suffix == ".parquet" else "json"
    if suffix not in (".parquet", ".jsonl", ".json", ".ndjson"):
        raise DataError(f"{path}: unsupported file type '{suffix}' (use .jsonl, .json or .parquet)")
    if builder == "json":
        lines = _scan_lines(path, config, stats, capped=suffix != ".json")
    if suffix in (".json", ".parquet"):  # rows bounded as JSONL lines are, before datasets holds a huge one
        try:
            check_rows(path, config.max_line_bytes, "data.max_line_bytes", "json" if suffix == ".json" else "parquet")
        except CoreDataError as exc:
            raise DataError(str(exc)) from None
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=config.cache_dir)
        rows = table.to_list()
    except Exception as exc:  # noqa: BLE001 - re-diagnosed below with the line at fault
        if builder == "parquet":
            raise DataError(f"{path}: cannot read Parquet file: {exc}") from exc
        return _read_json_lines(path, config, stats, exc)
    if builder == "json" and suffix != ".json":
        return rows, [f"line {n}" for n in lines] if len(lines) == len(rows) else [f"row {i}" for i in range(len(rows))]
    return rows, [f"row {i}" for i in range(len(rows))]


def _scan_lines(path: Path, config: MathFilesDatasetConfig, stats: dict[str, int], capped: bool) -> list[int]:
    """Numbers of the non-blank lines, reading at most ``max_line_bytes`` (+1) at a time so that
    a huge line costs no memory; raises DataError for an over-long line (``capped``), bytes that
    are not UTF-8 (unless ``decode_errors: replace``) or an empty file."""
    limit = config.max_line_bytes
    numbers, n, length, blank, replaced = [], 1, 0, True, False
    decoder = codecs.getincrementaldecoder("utf-8")()
    with path.open("rb") as f:
        while chunk := f.readline(limit + 1):
            if capped and length + len(chunk) > limit + (1 if chunk.endswith(b"\n") else 0):
                raise DataError(f"{path}, line {n}: longer than data.max_line_bytes={limit} bytes; "
                                "fix the line or raise data.max_line_bytes")
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                if config.decode_errors == "error":
                    at = length + exc.start - (len(exc.object) - len(chunk)) + 1
                    raise DataError(f"{path}, line {n}: byte 0x{exc.object[exc.start]:02x} at byte {at} of the line "
                                    "is not UTF-8; fix the file's encoding or set data.decode_errors=replace") from None
                decoder.reset()
                replaced = True
            length, blank = length + len(chunk), blank and not chunk.strip()
            if chunk.endswith(b"\n"):
                numbers += [] if blank else [n]
                stats["replaced_lines"] = stats.get("replaced_lines", 0) + replaced
                n, length, blank, replaced = n + 1, 0, True, False
    if not blank:
        numbers.append(n)
        stats["replaced_lines"] = stats.get("replaced_lines", 0) + replaced
    if not numbers:
        raise DataError(f"{path}: the file is empty (no rows)")
    return numbers


def _read_json_lines(path: Path, config: MathFilesDatasetConfig, stats: dict[str, int], cause: Exception):
    """Line-by-line reading when ``datasets`` refused the file: find the bad line, or skip bad lines."""
    rows, where = [], []
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            except ValueError as exc:
                if not config.skip_bad_rows:
                    raise DataError(f"{path}, line {n}: invalid JSON ({exc}); fix the line or set data.skip_bad_rows=true") from None
                stats["bad_rows"] += 1
                continue
            rows.append(row)
            where.append(f"line {n}")
    if not rows and not stats["bad_rows"]:
        raise DataError(f"{path}: cannot read as JSON lines: {str(cause).strip() or type(cause).__name__}")
    return rows, where


def _to_samples(rows: list[dict], where: list[str], path: Path | str, config: MathFilesDatasetConfig,
                stats: dict[str, int]) -> list[Sample]:
    prompt_col, answer_col, extraction = _columns(config)
    samples = []
    for row, location in zip(rows, where):
        try:
            question = _text(row, prompt_col)
            written = _text(row, answer_col)
            answer = _ground_truth(written, extraction, answer_col)
            response = _text(row, config.response_column) if config.response_column else written
        except DataError as exc:
            if not config.skip_bad_rows:
                raise DataError(f"{path}, {location}: {exc}; fix the row or set data.skip_bad_rows=true") from None
            stats["bad_rows"] += 1
            continue
        user = config.prompt_template.replace("{question}", question)
        samples.append(Sample(prompt=messages_for(user, config.system_prompt), answer=answer, response=response,
                              metadata={"source": str(path), "location": location, "question": question}))
    return samples


def _text(row: dict, column: str) -> str:
    if column not in row or row[column] is None:
        present = ", ".join(k for k, v in row.items() if v is not None)
        raise DataError(f"missing column '{column}' (present: {present or 'none'})")
    value = row[column]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"column '{column}' must be text or a number, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise DataError(f"column '{column}' is empty")
    problem = text_problem(text)
    if problem:
        raise DataError(f"column '{column}' {problem}")
    return text


def _ground_truth(answer: str, extraction: str, column: str) -> str:
    if extraction == "hash":
        found = hash_answer(answer)
        if found is None:
            raise DataError(f"column '{column}' has no final answer after '####'")
        return found
    if extraction == "boxed":
        found = last_boxed(answer)
        if found is None or not found.strip():
            raise DataError(f"column '{column}' has no closed \\boxed{{...}} answer")
        return found.strip()
    return answer
