"""``rlcore eval``: on a short run's checkpoint (and on its export) it reports the run's last
held-out accuracy (same recipe, seed, greedy), and its pass@k is the unbiased estimator.

A random tiny model answers nothing right, so the model is planted: its output layer can only
write digits, and half of the held-out answers are what it writes before training (the others
can never be written). Two steps of ``sft`` on the training problems' answers (the SFT loop,
whose validation decodes and scores as the GRPO loop's does) change some greedy answers; the test
asks that eval of the final checkpoint agrees with the run's own last validation.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from itertools import combinations
from pathlib import Path

import pytest
import yaml

from rlcore.cli.evaluation import pass_at_k

pytestmark = pytest.mark.slow


def test_pass_at_k_is_the_unbiased_estimator():
    # Chen et al. 2021: the chance that k of the n samples drawn without replacement hold a correct one.
    for n, c, k in [(5, 0, 1), (5, 2, 1), (5, 2, 2), (6, 3, 4), (4, 4, 2), (8, 1, 8)]:
        draws = list(combinations([1] * c + [0] * (n - c), k))
        assert math.isclose(pass_at_k(n, c, k), sum(any(d) for d in draws) / len(draws), rel_tol=1e-12)
    with pytest.raises(ValueError, match="needs at least 3 samples"):
        pass_at_k(2, 1, 3)


@pytest.fixture(scope="module")
def planted(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model that writes only digits, and data whose even held-out answers are its greedy outputs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.config.hf_generation import HFGenerationConfig
    from rlcore.generation.hf_generator import HFGenerator
    from rlcore.interfaces import SamplingParams

    root = tmp_path_factory.mktemp("eval")
    model_dir = root / "model"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    digits = set(tokenizer.convert_tokens_to_ids(list("0123456789")))
    with torch.no_grad():
        for token in range(model.lm_head.weight.shape[0]):
            if token not in digits:
                model.lm_head.weight[token].zero_()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in range(10)]
    val_rows = rows[::6][:12]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{r['problem']}="}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for r in val_rows]
    outputs = HFGenerator(str(model_dir), HFGenerationConfig(), 64).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=3))
    for i, (row, out) in enumerate(zip(val_rows, outputs)):
        row["answer"] = out[0].text if i % 2 == 0 else "-1"  # the model writes no minus sign
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val_rows))
    recipe = {
        "policy": {"model_name": str(model_dir), "precision": "float32", "max_total_sequence_length": 32,
                   "optimizer": {"lr": 2e-2, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True},
                   "generation": {"backend": "hf", "max_new_tokens": 3, "temperature": 1.0}},
        "algorithm": {"name": "sft"},  # trains on the reference sums: the greedy answers move
        "data": {"name": "math_jsonl", "preset": "deepscaler", "train_files": [str(root / "train.jsonl")],
                 "validation_files": [str(root / "val.jsonl")], "prompt_template": "{question}="},
        "env": {"name": "math", "math": {"executor": "inline", "answer_format": "none"}},
        "train": {"num_prompts_per_step": 4, "max_num_steps": 2, "val_period": 2, "val_at_start": True, "seed": 5,
                  "deterministic": True},
        "grpo": {"num_generations_per_prompt": 4},
        "logger": {"log_dir": str(root / "run"), "print_table": False, "plot": False},
        "checkpointing": {"enabled": True, "save_period": 2},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root


def test_eval_of_the_checkpoint_reports_the_runs_last_validation(planted):
    root = planted
    code = textwrap.dedent(f"""
        import json, rlcore
        from rlcore.cli.commands import main
        if __name__ == "__main__":
            rlcore.run(rlcore.load_config({str(root / 'recipe.yaml')!r}))
            assert main(["eval", {str(root / 'run')!r}, {str(root / 'recipe.yaml')!r}, "--k", "2", "--samples", "4",
                         "--no-progress", "--out", {str(root / 'eval_checkpoint.json')!r}]) == 0
            assert main(["export", {str(root / 'run')!r}, {str(root / 'exported')!r}]) == 0
            assert main(["eval", {str(root / 'exported')!r}, {str(root / 'recipe.yaml')!r}, "--no-progress",
                         "--batch-size", "5", "--k", "1", "--samples", "1", "--out", {str(root / 'eval_exported.json')!r}]) == 0
            assert main(["eval", {str(root / 'model')!r}, {str(root / 'recipe.yaml')!r}, "--no-progress", "--samples", "1",
                         "--out", {str(root / 'eval_base.json')!r}]) == 0
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((root / "run" / "summary.json").read_text())
    on_checkpoint = json.loads((root / "eval_checkpoint.json").read_text())
    on_export = json.loads((root / "eval_exported.json").read_text())
    on_base = json.loads((root / "eval_base.json").read_text())
    assert summary["val/accuracy_first"] == 0.5  # the planted answers: even rows right, odd rows never
    # The run moved the greedy answers, so eval of the base model (or of a stale checkpoint) would not match.
    assert summary["val/accuracy_last"] != summary["val/accuracy_first"]
    assert on_checkpoint["num_prompts"] == on_export["num_prompts"] == 12
    assert on_base["greedy_accuracy"] == summary["val/accuracy_first"]  # the weights the run started from
    assert on_checkpoint["greedy_accuracy"] == summary["val/accuracy_last"]
    assert on_export["greedy_accuracy"] == summary["val/accuracy_last"]  # in batches of 5: the same greedy answers
    assert on_checkpoint["exported_from"].endswith("step_000002")
    assert on_checkpoint["sampled_accuracy"] <= on_checkpoint["pass@2"] <= 1.0
    assert on_checkpoint["num_samples"] == 4 and on_checkpoint["generator"] == "hf"


def test_eval_names_a_missing_model(tmp_path, capsys):
    from rlcore.cli.commands import main

    recipe = Path(__file__).parents[1] / "recipes" / "grpo_arith_tiny_cpu.yaml"
    assert main(["eval", str(tmp_path / "nowhere"), str(recipe), "--no-progress"]) == 2
    assert "no such directory" in capsys.readouterr().err
