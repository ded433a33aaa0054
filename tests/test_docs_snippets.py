"""Every config the documentation shows is one rlcore accepts: each ```yaml block of README.md and
docs/ builds against the installed schemas, and each ``rlcore run|config recipes/...`` command's
``key=value`` overrides resolve on that recipe. A command shown with the ``error:`` line it prints
(a mistyped key, a moved one) must fail with exactly that line. A renamed or moved key thus fails
here, not in a reader's terminal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from rlcore.config import ConfigError
from rlcore.loading.loader import build_config, load_config
from rlcore.plugins import get_plugin_manager

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(language: str | None = None):
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            if language is None or match.group(1) == language:
                yield f"{page.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}", match.group(2)


YAML_BLOCKS = list(_blocks("yaml"))


def _commands():
    """``(where, argv, the error line shown after it or None)`` of each ``rlcore run|config`` of a recipe."""
    for where, body in _blocks():
        lines = [line.split("  #")[0].strip() for line in re.sub(r"\\\n\s*", " ", body).splitlines()]
        for i, line in enumerate(lines):
            line = line.removeprefix("$ ")
            if re.match(r"rlcore (run|config) recipes/\S+\.yaml", line):
                shown = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("error: ") else None
                yield where, shlex.split(line), shown


COMMANDS = list(_commands())


@pytest.mark.parametrize("where, body", YAML_BLOCKS, ids=[w for w, _ in YAML_BLOCKS])
def test_every_yaml_snippet_builds(where, body):
    tree = yaml.safe_load(body)
    assert isinstance(tree, dict), f"{where}: a config snippet is a mapping"
    # A snippet shows the keys it is about; what every run needs is filled in (a model, an algorithm).
    tree.setdefault("policy", {}).setdefault("model_name", "models/any")
    if isinstance(tree.get("algorithm"), dict):
        tree["algorithm"].setdefault("name", "grpo")
    build_config(tree, manager=get_plugin_manager())


@pytest.mark.parametrize("where, argv, shown", COMMANDS, ids=[f"{w}:{a[1]}:{a[2]}" for w, a, _ in COMMANDS])
def test_every_recipe_command_resolves(where, argv, shown, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name recipes/ of the checkout
    overrides = [a for a in argv[3:] if "=" in a and not a.startswith("-")]
    if shown is None:
        load_config(argv[2], overrides)
        return
    with pytest.raises(ConfigError) as failure:
        load_config(argv[2], overrides)
    assert f"error: {failure.value}" == shown, where


def test_the_snippets_are_found():
    assert len(YAML_BLOCKS) >= 8 and len(COMMANDS) >= 8
    assert any(shown for _, _, shown in COMMANDS)  # the error examples are checked too


def _figures(text: str) -> list[str]:
    return re.findall(r"(?<![\w.-])\d[\d,]*\.?\d*(?=\s?(?:s\b|%|generated|\)))", text)


def test_the_readme_quotes_only_measured_rows_of_rlcore():
    """README's performance figures are rlcore's rows of docs/performance.md (rounded), and it sets
    none beside a peer's figure: NeMo-RL's published rows are other work (GPU count, lengths, batch)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Performance", 1)[1].split("\n## ", 1)[0]
    assert "NeMo-RL" not in section, section
    ours = (ROOT / "docs" / "performance.md").read_text().split("\n## rlcore", 1)[1]
    measured = {float(n) for n in re.findall(r"\d+\.\d+|\d+", ours)}
    figures = _figures(section)
    assert len(figures) >= 5, figures
    for figure in figures:
        value = float(figure.replace(",", ""))
        digits = len(figure.split(".")[1]) if "." in figure else 0
        close = 0.5 * 10 ** -digits if "," not in figure else 50  # "3,500": a rounded hundred
        assert any(abs(m - value) <= close for m in measured), f"README's {figure} is no row of docs/performance.md"


def _performance_tables():
    import importlib.util

    spec = importlib.util.spec_from_file_location("performance_tables", ROOT / "benchmarks" / "performance_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_figures_in_the_docs_are_the_newest_recorded_demo():
    """README.md and docs/performance.md show the newest ``make demo`` row of benchmarks/results.jsonl,
    as ``performance_tables.py --write-demo`` writes them: no figure of the demo is typed by hand."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "performance_tables.py"), "--check-demo"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_recorded_demo_renders_as_the_demo_printed_it(tmp_path):
    """``python -m rlcore.cli.demo --record`` writes a row from the run's summary; the docs' block shows
    the warm start, the summary table and the accuracies of that row."""
    import json

    from rlcore.cli.demo import build_parser, demo_row, recorded_variant

    (tmp_path / "sft_history.json").write_text(json.dumps([{"step": 200, "loss": 0.9, "val_accuracy": 0.36, "seconds": 44.2}]))
    summary = {"window_first": 2, "window_last": 240, "timing/total": 1.2, "timing/training": 0.6, "timing/refit": 0.1,
               "timing/generation": 0.4, "timing/logprobs": 0.0, "timing/reward": 0.1, "rollout/mean_response_tokens": 3.4,
               "val/accuracy_first": 0.421875, "val/accuracy_last": 0.8125, "steps": 240, "run_id": "r"}
    row = json.loads(json.dumps(demo_row(summary, 288.4, tmp_path, "recipes/grpo_arith_tiny_cpu.yaml", [])))
    assert row["bench"] == "demo" and row["variant"] == "make demo" and row["config"] == "grpo_arith_tiny_cpu"
    assert recorded_variant(build_parser().parse_args([]), []) == []  # make demo's own run
    for flag in ("--ppo", "--tools", "--lora"):  # another mode's row is never taken for make demo's
        assert recorded_variant(build_parser().parse_args([flag]), []) == [flag]
    tables = _performance_tables()
    block = tables.demo_readme(row)
    assert "SFT warm start: 200 steps, 44s, held-out greedy accuracy 0.360" in block
    assert "│ 2-240 │ 1.20 │  0.60 │  0.10 │ 0.40 │     0.00 │    0.10 │        3.4 │" in block
    assert block.rstrip("`\n").endswith("GRPO took 288s; held-out accuracy 0.422 -> 0.812 (+0.391)")
    assert "| 240 | 200 steps, 44 s | 288 s | **1.20** |" in tables.demo_performance(row)


def test_a_row_run_under_allocator_settings_names_them_and_its_command_sets_them(tmp_path, monkeypatch):
    """torch's allocator settings change a run's memory: a row carries the settings it ran with, its variant names
    those other than rlcore.run's default (expandable segments), and the tables' commands set them again."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("results_log", ROOT / "benchmarks" / "results_log.py")
    results_log = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_log)
    monkeypatch.setenv("RLCORE_RESULTS", str(tmp_path / "rows.jsonl"))
    grpo_config = "32 prompts x 8 samples x 1024 new tokens, 8192-token micro-batches, steps 3 (summary after 1)"
    train_config = "1b, 4 x 8192 tokens/step/DP rank, lengths [1000, 1100], steps 2 (+1 warm-up)"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the default, as rlcore.run sets it
    results_log.append([{"variant": "llama1b-fsdp2", "step_s": 1.0}], bench="bench_grpo_step", config=grpo_config, gpus=1)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # torch's own defaults, asked for
    results_log.append([{"variant": "llama1b-fsdp2", "step_s": 1.0}], bench="bench_grpo_step", config=grpo_config, gpus=1)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8")
    results_log.append([{"variant": "fsdp2"}], bench="bench_train_megatron", config=train_config, gpus=1)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")  # a row of a process that set nothing (before the default)
    results_log.append([{"variant": "fsdp2"}], bench="bench_train_megatron", config=train_config, gpus=1)
    default, torch_default, train, unset = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert default["variant"] == "llama1b-fsdp2" and default["allocator_conf"] == "expandable_segments:True"
    assert torch_default["variant"] == "llama1b-fsdp2 [PYTORCH_CUDA_ALLOC_CONF=]" and torch_default["allocator_conf"] == ""
    assert train["variant"] == "fsdp2 [PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8]"
    assert unset["variant"] == "fsdp2" and "allocator_conf" not in unset
    tables = _performance_tables()
    assert tables.grpo_command(default).startswith("python benchmarks/bench_grpo_step.py --config llama1b-fsdp2 --steps 3")
    assert tables.grpo_command(torch_default).startswith(
        "PYTORCH_CUDA_ALLOC_CONF= python benchmarks/bench_grpo_step.py --config llama1b-fsdp2 --steps 3 --warmup 1")
    assert tables.train_command({**train, "layout": "FSDP=1"}).startswith(
        "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8 python benchmarks/bench_train_megatron.py --shape 1b "
        "--variants fsdp2 ")
    assert tables.train_command({**unset, "layout": "FSDP=1"}).startswith("python benchmarks/bench_train_megatron.py")


def test_a_repeated_hand_set_pair_shows_each_sides_mean_and_runs():
    """``FITS_PAIR_ORDER=ABBA``: the no-key side and the hand-set side each ran twice in one machine's calls; the pairs'
    table compares the means and lists each run. A run of the same configuration at another commit, or hours away,
    is not part of the pair."""
    tables = _performance_tables()
    hand_variant = "llama1b-fsdp2-ppo [policy.generation.gpu_memory_utilization=0.25]"

    def row(variant, minute, step, commit="abc1234", hour=22):
        return {"bench": "bench_grpo_step", "variant": variant, "machine": "1x NVIDIA H100 80GB HBM3", "commit": commit,
                "date": f"2026-12-07T{hour:02d}:{minute:02d}:00+00:00", "step_s": step, "generation_s": step / 2,
                "memory_plan/engine_fraction": 0.299}

    rows = [row("llama1b-fsdp2-ppo", 0, 30.0, commit="0ld0000"), row("llama1b-fsdp2-ppo", 0, 40.0, hour=18),
            row("llama1b-fsdp2-ppo", 1, 25.0), row(hand_variant, 5, 21.0), row(hand_variant, 9, 23.0),
            row("llama1b-fsdp2-ppo", 12, 19.0)]
    pairs = tables.hand_set_pairs([rows[4]], rows)
    assert pairs == [([rows[2], rows[5]], [rows[3], rows[4]])]
    line = tables.hand_set_table(pairs).splitlines()[-1]
    assert "| **22.00** (25.00, 19.00) | 11.00 |" in line and "| **22.00** (21.00, 23.00) | 11.00 | 1.00 |" in line
    # a hand-set run with no run of its configuration without the key on its commit is not a pair
    alone = row(hand_variant, 30, 20.0, commit="new0000")
    assert tables.hand_set_pairs([alone], [*rows, alone]) == []
