"""``rlcore export``: checkpoints of fsdp2 (2 data-parallel ranks), Megatron TP=2, PP=2 and TP=2 with LoRA,
each written by 2 gloo ranks, exported in one process to Hugging Face safetensors + config +
tokenizer; ``transformers`` then gives the same fp32 logits as the live backend's own export.

One launch of two processes (``_export_worker.py``) covers every layout: imports dominate."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from _preloaded_cli import PreloadedCli

from rlcore.cli.commands import main as rlcore_main
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


@pytest.fixture(scope="module")
def export_cli(tmp_path_factory):
    """``rlcore export SOURCE OUT`` in a process of its own, forked from a server that imported the
    libraries once (``_preloaded_cli``): its exit status, stdout and stderr as ``subprocess.run`` gives them."""
    cli, outputs = PreloadedCli(), tmp_path_factory.mktemp("export-cli")

    def export(source: Path, out: Path) -> subprocess.CompletedProcess:
        return cli.run_cli(["export", str(source), str(out)], dict(os.environ), outputs, timeout=120)

    yield export
    cli.close()


def test_export_to_a_full_disk_is_one_line_and_leaves_no_part(export_cli, tiny_model_dir, tmp_path, small_disk):
    run = _run_with_model(tiny_model_dir, tmp_path)
    done = export_cli(run, small_disk / "out")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: no space left on device: the export could not be written to "), done.stderr
    assert str(small_disk / "out") in done.stderr and "needs at least 1.3 MiB" in done.stderr, done.stderr
    assert list(small_disk.iterdir()) == []


# ---- what export copies stays inside the run directory -------------------------------------------
def _run_with_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A run directory as a run without checkpoints leaves it: its final model in ``model/``."""
    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "model")
    return run


@pytest.mark.parametrize("link", ["file_outside", "dir_outside", "model_dir_outside", "loop"])
def test_export_refuses_a_link_that_leaves_the_run_directory(export_cli, tiny_model_dir, tmp_path, link):
    run = _run_with_model(tiny_model_dir, tmp_path)
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    (secret / "secret.txt").write_text("SECRET-CONTENT")
    if link == "file_outside":
        (run / "model" / "notes.txt").symlink_to("/etc/passwd")
    elif link == "dir_outside":
        (run / "model" / "extra").symlink_to(secret)
    elif link == "model_dir_outside":  # the whole model directory is another one's
        shutil.copytree(run / "model", secret / "model")
        (secret / "model" / "notes.txt").write_text("SECRET-CONTENT")
        shutil.rmtree(run / "model")
        (run / "model").symlink_to(secret / "model")
    else:
        (run / "model" / "again").symlink_to("..")  # inside, but a copy would follow it forever
    done = export_cli(run, tmp_path / "out")
    assert done.returncode == 2, done.stderr[-2000:]
    error = done.stderr.strip().splitlines()
    assert len(error) <= 3 and "symbolic link" in done.stderr and "nothing was copied" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_export_copies_what_a_link_inside_the_run_directory_holds(export_cli, tiny_model_dir, tmp_path):
    run = _run_with_model(tiny_model_dir, tmp_path)
    (run / "notes.txt").write_text("run notes")
    (run / "model" / "notes.txt").symlink_to("../notes.txt")
    done = export_cli(run, tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    copied = tmp_path / "out" / "notes.txt"
    assert not copied.is_symlink() and copied.read_text() == "run notes"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


def test_export_refuses_a_checkpoint_holding_a_link_out_before_reading_it(export_cli, tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    (step / "backend").mkdir(parents=True)
    (step / "loop_state.pt").write_bytes(b"")
    (step / "backend" / "__0_0.distcp").symlink_to("/etc/passwd")
    done = export_cli(tmp_path / "run", tmp_path / "out")
    assert done.returncode == 2 and f"{step / 'backend' / '__0_0.distcp'} -> /etc/passwd" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()
