"""math_jsonl (GSM8K / MATH / DeepScaleR presets, JSONL and Parquet) and arithmetic datasets."""

from __future__ import annotations

import json
import logging
import re

import pytest

from rlcore.config.structure import structure
from rlcore.interfaces import PromptDataset
from rlcore.plugins import get_plugin_manager
from rlcore_math.grading import grade_text
from rlcore_math.prompts import DataError

GSM8K = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = 24.\nIn total 48+24 = 72.\n#### 72"},
    {"question": "A shirt costs 1,200 cents. What is that in cents?", "answer": "#### 1,200"},
    {"question": "What is 3.5 + 1?", "answer": "3.5 + 1 = 4.5\n#### 4.5"},
]
MATH = [
    {"problem": "Compute $\\frac{1}{2} + \\frac{1}{4}$.", "solution": "We get $\\boxed{\\frac{3}{4}}$.", "level": "Level 1"},
    {"problem": "Solve $x^2 = 4$ for $x>0$.", "solution": "So $x = 2$ and the answer is $\\boxed{2}$."},
]
DEEPSCALER = [
    {"problem": "Find the interval where $x^2 < 1$.", "answer": "(-1, 1)", "solution": "..."},
    {"problem": "What is $2^{10}$?", "answer": "1024"},
]


def write_jsonl(path, rows, blank_lines=False):
    text = "".join(json.dumps(r) + "\n" + ("\n" if blank_lines else "") for r in rows)
    path.write_text(text)
    return path


def build(tokenizer, tmp_path, **section):
    reg = get_plugin_manager().get("dataset", section["name"])
    if section["name"] == "math_jsonl":
        section.setdefault("cache_dir", str(tmp_path / "hf-cache"))
    return reg.build(structure(reg.config_cls, section, "data"), tokenizer)


def expected_ids(tokenizer, user):
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_gsm8k_preset(tiny_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K, blank_lines=True)
    ds = build(tiny_tokenizer, tmp_path, name="math_jsonl", preset="gsm8k", train_files=[str(path)],
               prompt_template="Q: {question}\nA:")
    assert isinstance(ds, PromptDataset) and ds.validation is None
    assert [s.answer for s in ds.train] == ["72", "1200", "4.5"]
    assert [s.index for s in ds.train] == [0, 1, 2]
    first = ds.train[0]
    assert first.prompt == [{"role": "user", "content": f"Q: {GSM8K[0]['question']}\nA:"}]
    assert first.prompt_ids == expected_ids(tiny_tokenizer, first.prompt[0]["content"])
    assert first.metadata["location"] == "line 1" and ds.train[1].metadata["location"] == "line 3"


def test_math_preset_from_parquet_with_system_prompt(tiny_tokenizer, tmp_path):
    import datasets

    path = tmp_path / "math.parquet"
    datasets.Dataset.from_list(MATH).to_parquet(str(path))
    ds = build(tiny_tokenizer, tmp_path, name="math_jsonl", preset="math", train_files=[str(path)],
               system_prompt="Be brief.")
    assert [s.answer for s in ds.train] == ["\\frac{3}{4}", "2"]
    assert ds.train[0].prompt[0] == {"role": "system", "content": "Be brief."}
    assert "\\boxed{}" in ds.train[0].prompt[1]["content"]  # default template asks for a boxed answer
    assert grade_text("so \\boxed{0.75}", ds.train[0].answer, timeout_s=5).correct


def test_deepscaler_preset_with_validation_file(tiny_tokenizer, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", DEEPSCALER)
    val = write_jsonl(tmp_path / "val.jsonl", DEEPSCALER[:1])
    ds = build(tiny_tokenizer, tmp_path, name="math_jsonl", preset="deepscaler", train_files=[str(train)],
               validation_files=[str(val)])
    assert [s.answer for s in ds.train] == ["(-1, 1)", "1024"]
    assert [s.answer for s in ds.validation] == ["(-1, 1)"]
    assert grade_text("\\boxed{(-1,1)}", ds.train[0].answer, timeout_s=5).correct


def test_validation_split_is_seeded_and_disjoint(tiny_tokenizer, tmp_path):
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(20)]
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    a = build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)], validation_size=5, seed=3)
    b = build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)], validation_size=5, seed=3)
    assert len(a.train) == 15 and len(a.validation) == 5
    assert [s.answer for s in a.validation] == [s.answer for s in b.validation]
    assert not {s.answer for s in a.train} & {s.answer for s in a.validation}


def test_missing_column_names_file_line_and_column(tiny_tokenizer, tmp_path):
    rows = [GSM8K[0], {"question": "No answer here"}, GSM8K[1]]
    path = write_jsonl(tmp_path / "broken.jsonl", rows, blank_lines=True)
    with pytest.raises(DataError) as err:
        build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)])
    message = str(err.value)
    assert str(path) in message and "line 3" in message and "missing column 'answer'" in message
    assert "skip_bad_rows" in message


def test_invalid_json_line_and_skip_bad_rows(tiny_tokenizer, tmp_path, caplog):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GSM8K[0]) + "\n" + '{"question": "cut off", "answer": \n' + json.dumps(GSM8K[1]) + "\n"
                    + json.dumps({"question": "x", "answer": "no marker"}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{path}, line 2: invalid JSON")):
        build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)])
    with caplog.at_level(logging.WARNING, logger="rlcore_math"):
        ds = build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)], skip_bad_rows=True)
    assert [s.answer for s in ds.train] == ["72", "1200"]
    assert ds.stats["bad_rows"] == 2  # the cut-off line and the answer without '####'
    assert "skipped 2 malformed rows" in caplog.text


def test_bad_parquet_row_names_row_and_column(tiny_tokenizer, tmp_path):
    import datasets

    path = tmp_path / "math.parquet"
    datasets.Dataset.from_list([MATH[0], {"problem": "p", "solution": "no box"}]).to_parquet(str(path))
    with pytest.raises(DataError, match=re.escape(f"{path}, row 1: column 'solution' has no closed \\boxed{{...}}")):
        build(tiny_tokenizer, tmp_path, name="math_jsonl", preset="math", train_files=[str(path)])


def test_long_prompts_are_dropped_and_counted(tiny_tokenizer, tmp_path, caplog):
    rows = [{"question": "short?", "answer": "#### 1"}, {"question": "long " * 100, "answer": "#### 2"}]
    path = write_jsonl(tmp_path / "lengths.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="rlcore_math"):
        ds = build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)], max_prompt_tokens=120)
    assert [s.answer for s in ds.train] == ["1"] and ds.stats["train/dropped_too_long"] == 1
    assert "dropped 1 of 2 prompts longer than data.max_prompt_tokens=120" in caplog.text
    with pytest.raises(DataError, match="every one of 2 prompts is longer"):
        build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(path)], max_prompt_tokens=5)


def test_missing_file_and_bad_config(tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        build(tiny_tokenizer, tmp_path, name="math_jsonl", train_files=[str(tmp_path / "nope.jsonl")])
    from rlcore.config import ConfigError

    with pytest.raises(ConfigError, match="custom"):
        build(tiny_tokenizer, tmp_path, name="math_jsonl", preset="custom", train_files=["x.jsonl"])


# ---- arithmetic ------------------------------------------------------------------------------
def test_arithmetic_is_deterministic_and_held_out(tiny_tokenizer, tmp_path):
    section = dict(name="arithmetic", digits=2, operations=["+"], num_train=500, num_validation=100, seed=1)
    a = build(tiny_tokenizer, tmp_path, **section)
    b = build(tiny_tokenizer, tmp_path, **section)
    c = build(tiny_tokenizer, tmp_path, **{**section, "seed": 2})
    exprs = lambda split: [s.metadata["expr"] for s in split]  # noqa: E731
    assert exprs(a.train) == exprs(b.train) and exprs(a.validation) == exprs(b.validation)
    assert exprs(a.train) != exprs(c.train)
    assert len(a.train) == 500 and len(set(exprs(a.validation))) == 100
    assert not set(exprs(a.train)) & set(exprs(a.validation))
    for sample in a.train[:50]:
        x, y = map(int, sample.metadata["expr"].split("+"))
        assert 0 <= x < 100 and 0 <= y < 100 and sample.answer == str(x + y)
        assert sample.prompt[-1]["content"] == sample.metadata["expr"] + "="


def test_arithmetic_prompts_fit_the_tiny_tokenizer(tiny_tokenizer, tmp_path):
    ds = build(tiny_tokenizer, tmp_path, name="arithmetic", level=5, num_train=200, num_validation=50,
               prompt_template="What is {expr}?")
    unk = tiny_tokenizer.unk_token_id
    assert all(unk not in s.prompt_ids for s in ds.train + ds.validation)
    sample = ds.train[0]
    assert tiny_tokenizer.decode(sample.prompt_ids) == f"<|user|>What is {sample.metadata['expr']}?<|assistant|>"
    assert all(len(re.findall(r"[+\-*]", s.metadata["expr"])) == 3 for s in ds.train)  # level 5: four terms
    raw = build(tiny_tokenizer, tmp_path, name="arithmetic", chat_template=False, num_train=5, num_validation=2)
    assert tiny_tokenizer.decode(raw.train[0].prompt_ids) == raw.train[0].metadata["expr"] + "="


def test_arithmetic_levels_and_answers_grade(tiny_tokenizer, tmp_path):
    ds = build(tiny_tokenizer, tmp_path, name="arithmetic", level=4, num_train=100, num_validation=20, seed=7)
    for sample in ds.train[:20]:
        expr = sample.metadata["expr"]
        assert len(re.findall(r"[+\-*]", expr)) == 2 and int(sample.answer) >= 0
        assert grade_text(sample.answer, sample.answer, timeout_s=5).correct
        assert grade_text(f"{expr}={sample.answer}", sample.answer, timeout_s=5).correct
    assert sum("*" in s.metadata["expr"] for s in ds.train) > 0


def test_arithmetic_too_small_space_is_a_clear_error(tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match="only 100 distinct problems"):
        build(tiny_tokenizer, tmp_path, name="arithmetic", digits=1, num_validation=60, num_train=10)
    from rlcore.config import ConfigError

    with pytest.raises(ConfigError, match="operations"):
        build(tiny_tokenizer, tmp_path, name="arithmetic", operations=["/"])


def test_arithmetic_level_conflicts_with_explicit_keys(tiny_tokenizer, tmp_path):
    from rlcore.config import ConfigError

    with pytest.raises(ConfigError, match=r"data\.level.*remove data\.digits"):
        build(tiny_tokenizer, tmp_path, name="arithmetic", level=3, digits=4)


def test_save_to_disk_directories_with_field_mapping_and_system_prompt(tiny_tokenizer, tmp_path):
    import datasets

    rows = [{"q": "What is 2+3?", "final": "5"}, {"q": "What is 7*6?", "final": "42"}, {"q": "What is 9-4?", "final": "5"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                          "test": datasets.Dataset.from_list(rows[2:])}).save_to_disk(str(tmp_path / "saved_dict"))
    datasets.Dataset.from_list(rows[2:]).save_to_disk(str(tmp_path / "saved_one"))
    section = dict(name="math_jsonl", preset="custom", prompt_column="q", answer_column="final", system_prompt="Be brief.",
                   prompt_template="{question}")
    ds = build(tiny_tokenizer, tmp_path, train_files=[str(tmp_path / "saved_dict")], validation_split="test", **section)
    assert [s.answer for s in ds.train] == ["5", "42"] and [s.answer for s in ds.validation] == ["5"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    assert ds.train[0].prompt == messages
    assert ds.train[0].prompt_ids == tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                        return_dict=False)
    alone = build(tiny_tokenizer, tmp_path, train_files=[str(tmp_path / "saved_one")], **section)
    assert [s.metadata["question"] for s in alone.train] == ["What is 9-4?"]
    with pytest.raises(Exception, match=r"data.train_split.*holds the splits \['test', 'train'\], not 'training'"):
        build(tiny_tokenizer, tmp_path, train_files=[str(tmp_path / "saved_dict")], train_split="training", **section)
    (tmp_path / "not_saved").mkdir()
    with pytest.raises(DataError, match="not one written by datasets.save_to_disk"):
        build(tiny_tokenizer, tmp_path, train_files=[str(tmp_path / "not_saved")], **section)


def test_chat_template_off_encodes_the_text_as_is(tiny_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DEEPSCALER)
    ds = build(tiny_tokenizer, tmp_path, name="math_jsonl", preset="deepscaler", train_files=[str(path)],
               prompt_template="Q: {question} A:", chat_template=False)
    text = f"Q: {DEEPSCALER[1]['problem']} A:"
    assert ds.train[1].prompt_ids == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_hub_dataset_offline_is_a_clear_error(tiny_tokenizer, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets; this machine has no hub either
    with pytest.raises(Exception, match=r"config key 'data.hub_dataset': 'openai/gsm8k' \(subset 'main', split 'train'\) "
                                        r"could not be loaded: .*save_to_disk"):
        build(tiny_tokenizer, tmp_path, name="math_jsonl", hub_dataset="openai/gsm8k", hub_subset="main")
    with pytest.raises(Exception, match="either data.train_files or data.hub_dataset"):
        build(tiny_tokenizer, tmp_path, name="math_jsonl", hub_dataset="openai/gsm8k", train_files=["x.jsonl"])


def test_reference_responses_are_the_answer_column_as_written_or_the_response_column(tiny_tokenizer, tmp_path):
    """``Sample.response``, what the sft algorithm trains on: GSM8K's worked solution (its ground
    truth the number after ####), or another column's text (OpenMathInstruct-2's generated_solution)."""
    gsm8k = build(tiny_tokenizer, tmp_path, name="math_jsonl", preset="gsm8k",
                  train_files=[str(write_jsonl(tmp_path / "g.jsonl", GSM8K))])
    assert gsm8k.train[0].answer == "72" and gsm8k.train[0].response == GSM8K[0]["answer"]
    rows = [{"problem": "What is 2+3?", "expected_answer": "5", "generated_solution": "2+3 is \\boxed{5}."}]
    custom = build(tiny_tokenizer, tmp_path, name="math_jsonl", preset="custom", prompt_column="problem",
                   answer_column="expected_answer", response_column="generated_solution",
                   train_files=[str(write_jsonl(tmp_path / "o.jsonl", rows))])
    assert custom.train[0].answer == "5" and custom.train[0].response == "2+3 is \\boxed{5}."
    with pytest.raises(DataError, match=r"o\.jsonl, line 1: missing column 'solution'"):
        build(tiny_tokenizer, tmp_path, name="math_jsonl", preset="custom", prompt_column="problem",
              answer_column="expected_answer", response_column="solution", train_files=[str(tmp_path / "o.jsonl")])
