"""``rlcore export``: checkpoints of fsdp2 (2 data-parallel ranks), Megatron TP=2, PP=2 and TP=2 with LoRA,
each written by 2 gloo ranks, exported in one process to Hugging Face safetensors + config +
tokenizer; ``transformers`` then gives the same fp32 logits as the live backend's own export.

One launch of two processes (``_export_worker.py``) covers every layout: imports dominate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlcore.cli import main as rlcore_main
from rlcore.testing.ranks import rank_results

WORKER = Path(__file__).with_name("_export_worker.py")
LAYOUTS = ("fsdp2_dp2", "megatron_tp2", "megatron_pp2", "megatron_tp2_lora")


@pytest.fixture(scope="module")
def exported(tiny_model_factory, tmp_path_factory):
    model = str(tiny_model_factory("llama", hidden_size=256, num_heads=4, num_kv_heads=2))
    out = tmp_path_factory.mktemp("export")
    return out, rank_results(WORKER, [model, out], out / "results.json", what="export workers", timeout=400)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_round_trip_logits_equal(exported, layout):
    _, results = exported
    result = results[layout]
    if isinstance(result, str):
        pytest.fail(f"{layout}: {result}")
    assert result["exit_code"] == 0
    assert result["logits_vs_reference"] < 1e-5  # fp32: the exported model is the checkpoint's
    assert result["logits_vs_base"] > 1e-3  # the checkpoint's step really moved the weights
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(result["files"])
    assert result["tokenizer_roundtrip"] == "12+7="


def test_export_names_a_missing_checkpoint(tmp_path, capsys):
    assert rlcore_main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert f"checkpoint not found: {tmp_path / 'nowhere'}" in capsys.readouterr().err


def test_export_refuses_a_directory_without_checkpoints(tmp_path, capsys):
    (tmp_path / "checkpoints" / "step_000002.tmp").mkdir(parents=True)  # an unfinished save is not a checkpoint
    assert rlcore_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "holds no complete rlcore checkpoint" in capsys.readouterr().err
