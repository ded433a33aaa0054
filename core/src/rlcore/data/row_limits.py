"""Bounds on a data file's rows, checked before a library parses the file.

``datasets`` reads JSON and Parquet in blocks it grows until a row fits: one 20 MB row makes it
hold gigabytes. So each file is first checked here, in bounded memory, against a per-row byte
limit: JSON Lines line by line (``readline`` with a cap: a huge line is never held whole);
a ``.json`` document (an array of rows, or ``{"data": [...]}``) by its size, then row by row;
Parquet record batch by record batch through pyarrow, summing the bytes of each row's values.
The error names the file, the line or row, and the config key that sets the limit. Lines are
also checked to be UTF-8 (an error naming the line and byte), and strings for lone surrogates
(``"\\ud800"`` escapes, which tokenizers reject), which JSON allows and UTF-8 text cannot hold.

Hand-written: no library checks row sizes without first reading the rows.
"""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path
from typing import Any

from rlcore.errors import DataError

JSON_LINES = (".jsonl", ".ndjson")
# A .json document is parsed whole (json.load: a few times its size in memory); beyond this many
# rows' worth of the limit it must be JSON Lines.
_JSON_DOCUMENT_ROWS = 64


def check_rows(path: str | Path, limit: int, key: str, kind: str | None = None) -> None:
    """Raise DataError naming ``path``, the row and ``key`` when a row of the file is over ``limit``
    bytes (or a line is not UTF-8). ``kind``: "jsonl", "json" or "parquet" (None: by suffix)."""
    path = Path(path)
    kind = kind or ("parquet" if path.suffix.lower() == ".parquet" else "json" if path.suffix.lower() == ".json" else "jsonl")
    {"jsonl": _check_lines, "json": _check_document, "parquet": _check_parquet}[kind](path, limit, key)


def _check_lines(path: Path, limit: int, key: str) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, length = 1, 0
    with path.open("rb") as f:
        while chunk := f.readline(limit + 1):
            length += len(chunk)
            if length > limit + (1 if chunk.endswith(b"\n") else 0):
                raise DataError(f"{path}, line {line}: longer than {key}={limit} bytes; fix the line or raise {key}")
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}, line {line}: byte 0x{exc.object[exc.start]:02x} is not UTF-8; save the file "
                                "as UTF-8") from None
            if _SURROGATE_ESCAPE.search(chunk) and length == len(chunk):  # the whole line is in hand
                problem = _line_text_problem(chunk)
                if problem:
                    raise DataError(f"{path}, line {line}: {problem}")
            if chunk.endswith(b"\n"):
                line, length = line + 1, 0


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _line_text_problem(chunk: bytes) -> str | None:
    try:
        return text_problem(json.loads(chunk))
    except ValueError:
        return None  # not JSON: the reader names the line


def _check_document(path: Path, limit: int, key: str) -> None:
    size = path.stat().st_size
    if size > limit * _JSON_DOCUMENT_ROWS:
        raise DataError(f"{path}: a .json document of {size} bytes is parsed whole; over {_JSON_DOCUMENT_ROWS} x "
                        f"{key}={limit} bytes, write it as JSON Lines (.jsonl, one row a line)")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: byte 0x{exc.object[exc.start]:02x} at byte {exc.start} is not UTF-8; save the file as UTF-8") from None
    except ValueError:
        return  # not one JSON document: the reader says where, or tries it as JSON Lines
    rows = data.get("data") if isinstance(data, dict) and isinstance(data.get("data"), list) else data
    for index, row in enumerate(rows if isinstance(rows, list) else [rows]):
        size = len(json.dumps(row, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > limit:
            raise DataError(f"{path}, row {index}: {size} bytes, over {key}={limit}; fix the row or raise {key}")


def _check_parquet(path: Path, limit: int, key: str) -> None:
    import pyarrow.parquet as pq

    try:
        source = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's error types; the reader reports it in full
        raise DataError(f"{path}: cannot read Parquet file: {exc}") from None
    first = 0
    for batch in source.iter_batches(batch_size=64):
        if batch.nbytes > limit:  # some row may be over: measure each (nbytes counts a slice's own range)
            for offset in range(batch.num_rows):
                size = batch.slice(offset, 1).nbytes
                if size > limit:
                    raise DataError(f"{path}, row {first + offset}: {size} bytes, over {key}={limit}; fix the row or "
                                    f"raise {key}")
        first += batch.num_rows


def text_problem(value: Any) -> str | None:
    """Why ``value`` (a row's text, or messages holding text) cannot be tokenized, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"holds a lone surrogate {value[exc.start]!r} at character {exc.start} (an unpaired \\ud800-\\udfff escape)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            problem = text_problem(item)
            if problem:
                return problem if problem.startswith("'") else f"'{key}' {problem}"
        return None
    if isinstance(value, (list, tuple)):
        for item in value:
            problem = text_problem(item)
            if problem:
                return problem
    return None
