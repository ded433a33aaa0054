"""Plugins for one run that no distribution installs: modules named in ``RLCORE_PLUGINS`` are
registered after the entry points, and the ``rlcore_wrap_trainer`` hook wraps the run's trainer.
The test-only fault plugin (``rlcore.testing.faults``) is the one the kill/resume tests use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlcore.plugins import PluginError, PluginManager
from rlcore.testing.faults import ENV, FaultInjectingTrainer, FaultSpec, fault_env


def loaded(monkeypatch, **env: str) -> PluginManager:
    for key in ("RLCORE_PLUGINS", ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    manager = PluginManager()
    manager.load_entry_points()
    return manager


def test_the_fault_plugin_named_in_the_environment_wraps_the_trainer(monkeypatch):
    trainer = SimpleNamespace(loop_step=0)
    manager = loaded(monkeypatch, **fault_env("hang:train:2:0"))
    wrapped = manager.wrap_trainer(trainer)
    assert isinstance(wrapped, FaultInjectingTrainer) and wrapped.inner is trainer
    assert wrapped.spec == FaultSpec("hang", "train", 2, 0)
    assert any(s.entry_point == "rlcore.testing.faults (RLCORE_PLUGINS)" for s in manager.sources)


def test_without_a_fault_or_the_plugin_the_trainer_is_left_as_it_is(monkeypatch):
    trainer = SimpleNamespace(loop_step=0)
    assert loaded(monkeypatch).wrap_trainer(trainer) is trainer
    assert loaded(monkeypatch, RLCORE_PLUGINS="rlcore.testing.faults").wrap_trainer(trainer) is trainer
    assert loaded(monkeypatch, **{ENV: "crash:train:1"}).wrap_trainer(trainer) is trainer  # the plugin not registered


def test_a_module_that_does_not_import_is_named(monkeypatch):
    with pytest.raises(PluginError, match=r"no_such_plugin_module \(RLCORE_PLUGINS\).*failed to import.*ModuleNotFoundError"):
        loaded(monkeypatch, RLCORE_PLUGINS="rlcore.testing.faults, no_such_plugin_module")


def test_a_wrong_fault_spec_fails_in_the_test():
    with pytest.raises(ValueError, match=r"RLCORE_FAULT='crash:train'.*<crash\|hang>:<call>:<step>"):
        fault_env("crash:train")
