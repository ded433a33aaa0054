"""rlcore.run's allocator default: expandable segments where neither the user nor an earlier CUDA start decided."""

from __future__ import annotations

import os
import subprocess
import sys

from rlcore.controller import allocator


def test_sets_expandable_segments_for_the_process_and_its_children(monkeypatch):
    monkeypatch.delenv(allocator.ALLOCATOR_ENV, raising=False)
    assert allocator.use_expandable_segments() == "expandable_segments:True"
    assert os.environ[allocator.ALLOCATOR_ENV] == "expandable_segments:True"
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ['{allocator.ALLOCATOR_ENV}'])"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "expandable_segments:True"


def test_the_users_settings_win_even_empty_ones(monkeypatch):
    monkeypatch.setenv(allocator.ALLOCATOR_ENV, "garbage_collection_threshold:0.8")
    assert allocator.use_expandable_segments() == "garbage_collection_threshold:0.8"
    assert os.environ[allocator.ALLOCATOR_ENV] == "garbage_collection_threshold:0.8"
    monkeypatch.setenv(allocator.ALLOCATOR_ENV, "")  # torch's own defaults, asked for
    assert allocator.use_expandable_segments() is None
    assert os.environ[allocator.ALLOCATOR_ENV] == ""


def test_a_process_that_started_cuda_keeps_torchs_settings_and_is_told(monkeypatch, capsys):
    monkeypatch.delenv(allocator.ALLOCATOR_ENV, raising=False)
    monkeypatch.setattr(allocator, "cuda_initialized", lambda: True)  # torch read its settings already
    assert allocator.use_expandable_segments() is None
    assert allocator.ALLOCATOR_ENV not in os.environ
    assert "CUDA started before the run" in capsys.readouterr().out


def test_a_ray_rank_takes_the_default_where_its_node_set_nothing(monkeypatch):
    """A trainer rank on a Ray cluster the run joined does not inherit the driver's environment."""
    from rlcore.controller.workers import _TrainerActor
    from rlcore.interfaces import Placement

    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the rank's thread count is not this process's
    monkeypatch.delenv(allocator.ALLOCATOR_ENV, raising=False)
    _TrainerActor(None, None, None, 0, Placement(trainer_ranks=2, use_ray=True))
    assert os.environ[allocator.ALLOCATOR_ENV] == "expandable_segments:True"
    monkeypatch.setenv(allocator.ALLOCATOR_ENV, "garbage_collection_threshold:0.8")  # the node's (or the driver's)
    _TrainerActor(None, None, None, 1, Placement(trainer_ranks=2, use_ray=True))
    assert os.environ[allocator.ALLOCATOR_ENV] == "garbage_collection_threshold:0.8"
