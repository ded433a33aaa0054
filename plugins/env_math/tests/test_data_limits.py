"""Data checked when loaded, not when drawn: over-long lines and prompts, bytes that are not
UTF-8 and empty files are found before the run starts, naming the file and the line."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from rlcore.config import ConfigError
from rlcore.config.schema import PolicyConfig, RunConfig
from rlcore.runtime import check_prompt_lengths
from rlcore_math.prompts import DataError
from test_datasets import GSM8K, build, write_jsonl


def test_a_huge_line_is_refused_before_parsing_naming_file_and_line(tiny_tokenizer, tmp_path):
    build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(write_jsonl(tmp_path / "ok.jsonl", GSM8K))])
    path = write_jsonl(tmp_path / "big.jsonl", GSM8K[:1])
    with path.open("a") as f:
        f.write(json.dumps({"question": "x" * (20 << 20), "answer": "#### 1"}) + "\n")
    tracemalloc.start()
    with pytest.raises(DataError) as failure:
        build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)], max_line_bytes=1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert f"{path}, line 2" in str(failure.value) and "data.max_line_bytes" in str(failure.value)
    assert peak < 8 << 20, f"reading a 20 MB line took {peak >> 20} MB"


def test_bytes_that_are_not_utf8_are_an_error_or_counted(tiny_tokenizer, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GSM8K[0]).encode() + b"\n" + b'{"question": "caf\xe9?", "answer": "#### 2"}\n')
    with pytest.raises(DataError) as failure:
        build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)])
    assert f"{path}, line 2" in str(failure.value) and "0xe9" in str(failure.value) and "data.decode_errors" in str(failure.value)
    ds = build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)], decode_errors="replace")
    assert ds.stats["replaced_lines"] == 1 and len(ds.train) == 2


def test_an_empty_file_says_so(tiny_tokenizer, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match="empty"):
        build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)])


def _config(limit: int, mode: str = "drop") -> RunConfig:
    return RunConfig(policy=PolicyConfig(model_name="m", max_total_sequence_length=limit, overlong_prompts=mode))


def test_prompts_with_no_room_for_a_response_are_dropped_at_load_naming_rows(tiny_tokenizer, tmp_path, capsys):
    rows = GSM8K[:2] + [{"question": "long " * 200, "answer": "#### 3"}] + GSM8K[2:]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    ds = build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)])
    limit = max(len(s.prompt_ids) for s in ds.train if "long" not in s.metadata["question"]) + 8
    assert check_prompt_lengths(ds, _config(limit)) == {"train": 1}
    assert [s.answer for s in ds.train] == ["72", "1200", "4.5"] and [s.index for s in ds.train] == [0, 1, 2]
    out = capsys.readouterr().out
    assert "1 of 4 prompts" in out and f"{path}, line 3" in out
    ds = build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)])
    with pytest.raises(ConfigError) as failure:
        check_prompt_lengths(ds, _config(limit, "error"))
    assert failure.value.key == "policy.max_total_sequence_length" and "line 3" in str(failure.value)
