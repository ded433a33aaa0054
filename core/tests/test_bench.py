"""``rlcore bench``: the step benchmark runs the real ``rlcore.run`` path on a random-init model of the
recipe's shape, prints NeMo-RL's step-time table and appends one JSON row to its run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.cli.bench.models import SHAPES, llama_params, shape_of
from rlcore.cli.bench.report import config_digest, peak_flops

REPO = Path(__file__).resolve().parents[2]


def test_peak_flops_are_keyed_by_the_devices_name():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA GH200 480GB") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu (x86_64)") is None


def test_the_shape_comes_from_the_recipes_model_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a checkout where the demo ran has a real runs/demo/sft, which is a local model
    assert shape_of("runs/demo/sft") == "demo" and shape_of("meta-llama/Llama-3.2-1B") == "llama1b"
    local = tmp_path / "model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert shape_of(str(local)) is None  # a local directory: its own config
    with pytest.raises(SystemExit, match="--shape"):
        shape_of("someone/unknown-model")
    # Llama-3.2-1B's published size with untied embeddings: 1.50B
    assert llama_params(SHAPES["llama1b"]) == pytest.approx(1.498e9, rel=1e-3)


def test_the_config_digest_follows_the_config():
    assert config_digest({"a": 1, "b": [2]}) == config_digest({"b": [2], "a": 1}) != config_digest({"a": 2, "b": [2]})


@pytest.mark.parametrize("option, value", [("--warmup", "-1"), ("--steps", "0")])
def test_a_negative_warmup_or_no_steps_is_refused_naming_the_option(tmp_path, option, value):
    done = subprocess.run([sys.executable, "-m", "rlcore.cli", "bench", "step", str(REPO / "recipes" / "grpo_arith_tiny_cpu.yaml"),
                           option, value, "--out", str(tmp_path / "bench")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"argument {option}: must be at least" in done.stderr and "summary_window" not in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "bench").exists()


def test_bench_step_prints_the_table_and_appends_the_row(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "rlcore.cli", "bench", "step", str(REPO / "recipes" / "grpo_arith_tiny_cpu.yaml"),
         "policy.generation.backend=hf", "train.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
         "policy.generation.max_new_tokens=2", "logger.print_table=false", "--shape", "tiny", "--steps", "2",
         "--warmup", "1", "--out", str(out), "--workdir", str(tmp_path / "models")],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-3000:]
    # a CPU run is labelled as one: no "GPUs 1", the generation rate is the machine's
    assert "| Device | Step (s) | Train | Refit | Generation | Logprobs | Tokens/sample | Gen tok/s | MFU |" in done.stdout
    assert "\n| CPU | " in done.stdout and "| GPUs |" not in done.stdout
    assert "Writing model shards" not in done.stdout + done.stderr  # the random-init model is saved quietly
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["shape"] == "tiny" and row["steps_averaged"] == 1 and row["mfu"] is None  # no peak for a CPU
    assert row["tokens_per_sample"] == 2.0  # ignore_eos: every response runs to max_new_tokens
    assert row["step"] >= row["training"] > 0 and row["generation"] > 0 and row["refit"] > 0
    assert row["gen_tokens_per_s"] == pytest.approx(4 * 2 / row["step"]) and row["gen_tokens_per_gpu_s"] is None
    assert row["gpus"] == 0
    assert row["versions"]["torch"] and row["config_digest"] and row["device"].startswith("cpu")
    assert row["commit"] is None or len(row["commit"]) >= 7
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2]  # the real run's records, in the bench's run directory


def test_a_local_vision_language_directory_gets_new_weights_and_keeps_its_processor(tmp_path):
    from transformers import AutoModelForImageTextToText

    from rlcore.cli.bench.models import build_model, model_info
    from rlcore.testing.tiny_vlm import build_tiny_vlm

    source = build_tiny_vlm(tmp_path / "source")
    (source / "model.safetensors").unlink()  # a config directory: the bench makes the weights
    built = build_model(str(source), tmp_path / "work")
    assert built != source and {"preprocessor_config.json", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in built.iterdir()}
    model = AutoModelForImageTextToText.from_pretrained(built)
    info = model_info(built)
    assert info["params"] == sum(p.numel() for p in model.parameters())
    assert (info["num_layers"], info["hidden_size"]) == (2, 128)  # the language model's, from text_config
