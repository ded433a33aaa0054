"""Run checkpoints as untrusted, fallible input: nothing in them runs on load, a damaged newest
one is skipped for the previous complete one, a full disk is named and leaves no ``.tmp``.

The backend part of these checkpoints is written by a plain ``torch.save`` (the real backends'
files are covered by the conformance suite and tests/test_run_safety.py); the loop state is
the real one.
"""

from __future__ import annotations

import errno
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from rlcore.controller.checkpoint import LOOP_STATE, CheckpointManager, CheckpointWriteError, rng_state, set_rng_state
from rlcore.errors import CheckpointError, UnsafeCheckpointError
from rlcore.training.safe_load import load_tensors
from rlcore.testing.planting import plant


def _save_backend(path: str) -> None:
    Path(path).mkdir()
    torch.save({"w": torch.arange(4.0)}, Path(path) / "weights.pt")


def _load_backend(path) -> None:
    load_tensors(path / "weights.pt")


def _state(step: int) -> dict:
    return {"step": step, "data_position": 4 * step, "records": [{"step": s, "timing/total": 1.0} for s in range(1, step + 1)],
            "rng": rng_state(),
            "run": {"run_id": "r1", "log_dir": "x", "fingerprint": {"train.seed": "1"}}}


def _accept(path, state) -> None:
    return None


def test_loop_state_loads_weights_only_and_restores_every_rng(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_k=2)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = manager.save(1, _save_backend, _state(1))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    state = torch.load(path / LOOP_STATE, weights_only=True)  # plain weights_only: no allow-list needed
    set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_planted_loop_state_runs_nothing_and_names_the_file(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", keep_last_k=2)
    path = manager.save(1, _save_backend, _state(1))
    marker = tmp_path / "ran"
    plant(path / LOOP_STATE, marker)
    with pytest.raises(UnsafeCheckpointError, match=LOOP_STATE):
        manager.resume(_accept, _load_backend)
    assert not marker.exists()


def test_resume_skips_a_damaged_newest_checkpoint_saying_why(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep_last_k=3)
    for step in (1, 2, 3):
        manager.save(step, _save_backend, _state(step))
    weights = tmp_path / "step_000003" / "backend" / "weights.pt"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as by a crash or a full disk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, state = manager.resume(_accept, _load_backend)
    assert path.name == "step_000002" and state["step"] == 2
    assert any("step_000003" in str(w.message) and "weights.pt" in str(w.message) for w in caught)
    assert "skipped checkpoint" in capsys.readouterr().out


def test_resume_with_every_checkpoint_damaged_names_each(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_k=3)
    for step in (1, 2):
        manager.save(step, _save_backend, _state(step))
        (tmp_path / f"step_{step:06d}" / LOOP_STATE).write_bytes(b"PK\x03\x04 cut")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError) as failure:
            manager.resume(_accept, _load_backend)
    assert "step_000001" in str(failure.value) and "step_000002" in str(failure.value)
    assert "--no-resume" in str(failure.value)


def test_disk_full_during_save_says_so_and_removes_the_tmp(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_k=2)
    manager.save(1, _save_backend, _state(1))

    def save_until_full(path: str) -> None:  # injected fault: the write call fails with ENOSPC
        _save_backend(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointWriteError, match="no space left on device") as failure:
        manager.save(2, save_until_full, _state(2))
    assert "step_000002.tmp" in str(failure.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert [step for step, _ in manager.complete()] == [1]



@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_real_enospc_from_the_kernel_is_named_too(tmp_path):
    """The loop state's file is /dev/full, whose writes fail with ENOSPC: torch's own file writer
    would say only "unexpected pos 704 vs 598"."""
    manager = CheckpointManager(tmp_path, keep_last_k=2)

    def backend_then_full_disk(path: str) -> None:
        _save_backend(path)
        (Path(path).parent / LOOP_STATE).symlink_to("/dev/full")

    with pytest.raises(CheckpointWriteError, match="no space left on device"):
        manager.save(1, backend_then_full_disk, _state(1))
    assert list(tmp_path.iterdir()) == []


# ---- an output directory is replaced whole or not at all ---------------------------------------
def _safetensors_disk_full(path: Path) -> None:
    """Injected fault: the error safetensors raises when the disk fills during ``save_file``
    (a real full disk: tests/test_run_safety.py, on a small tmpfs)."""
    from safetensors import SafetensorError

    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 4096)
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')


@pytest.mark.parametrize("earlier", [True, False])
def test_a_full_disk_keeps_the_earlier_output_and_says_how_much_space(tmp_path, earlier):
    from rlcore.config.run_paths import OutputWriteError, replace_dir

    model = tmp_path / "model"
    if earlier:
        model.mkdir()
        (model / "model.safetensors").write_bytes(b"earlier")
    with pytest.raises(OutputWriteError) as failure:
        replace_dir(model, _safetensors_disk_full, "the final model", needed_bytes=3 << 20)
    message = str(failure.value)
    assert "\n" not in message and str(model) in message and "needs at least 3.0 MiB" in message and "MiB free" in message
    assert ("the earlier" in message) == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == (["model"] if earlier else [])
    if earlier:
        assert (model / "model.safetensors").read_bytes() == b"earlier"


def test_a_complete_output_replaces_the_earlier_one_and_a_link_in_its_place_is_not_followed(tmp_path, outside_dir):
    from rlcore.config.run_paths import replace_dir

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model").symlink_to(outside_dir)

    def write(path: Path) -> None:
        path.mkdir()
        (path / "config.json").write_text("{}")

    replace_dir(tmp_path / "run" / "model", write, "the final model")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["model"]
    assert not (tmp_path / "run" / "model").is_symlink() and (tmp_path / "run" / "model" / "config.json").exists()
    assert sorted(p.name for p in outside_dir.iterdir()) == ["keep.txt"]
