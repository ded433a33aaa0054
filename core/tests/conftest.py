"""Shared helpers of rlcore's own tests: fake installed distributions, running the CLI, and the
multi-turn tests' hf generator.

Plugins are discovered the real way, through ``importlib.metadata``: a fake distribution is a
``<name>-<version>.dist-info`` directory (``METADATA`` + ``entry_points.txt``) beside its modules
in a directory put on ``sys.path`` (in-process) or ``PYTHONPATH`` (subprocess). No mocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest


class FakeSite:
    """A directory of fake installed distributions with ``rlcore`` entry points."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.modules: list[str] = []
        # Module names are unique per test so in-process imports never hit a stale sys.modules.
        self.tag = uuid.uuid4().hex[:8]

    def module_name(self, base: str) -> str:
        return f"{base}_{self.tag}"

    def add_module(self, name: str, source: str) -> str:
        (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        self.modules.append(name)
        return name

    def add_distribution(self, dist: str, entry_points: dict[str, str], version: str = "1.0.0", requires=("rlcore",)) -> None:
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        metadata = ["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}"]
        metadata += [f"Requires-Dist: {r}" for r in requires]
        (info / "METADATA").write_text("\n".join(metadata) + "\n")
        lines = ["[rlcore]"] + [f"{name} = {target}" for name, target in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")

    def add_plugin(self, dist: str, ep_name: str, source: str, version: str = "1.0.0") -> str:
        """One distribution with one entry point whose module has ``source``; returns the module name."""
        module = self.add_module(self.module_name(ep_name), source)
        self.add_distribution(dist, {ep_name: module}, version)
        return module

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a subprocess that sees these distributions (and only our RLCORE_* vars)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
        env["PYTHONPATH"] = os.pathsep.join([str(self.root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        env.update(extra)
        return env


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """Fake distributions visible to this process (sys.path) and to subprocesses (``site.env()``)."""
    for var in ("RLCORE_DISABLE_PLUGINS", "RLCORE_NO_AUTOLOAD"):
        monkeypatch.delenv(var, raising=False)
    site = FakeSite(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site.root))  # also invalidates import caches
    yield site
    for name in site.modules:
        sys.modules.pop(name, None)


def _rlcore_script() -> list[str]:
    """The installed ``rlcore`` console script of the running interpreter's environment."""
    script = Path(sys.executable).parent / "rlcore"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rlcore.cli"]


def _run_cli(*args: str, env: dict | None = None, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    env = dict(env, COLUMNS="250", NO_COLOR="1")
    return subprocess.run([*_rlcore_script(), *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


def _run_python(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    env = dict(env, COLUMNS="250", NO_COLOR="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture
def run_cli():
    """``run_cli(*args, env=None, timeout=120)``: the installed ``rlcore`` script in a subprocess."""
    return _run_cli


@pytest.fixture
def run_python():
    """``run_python(code, env=None, timeout=120)``: a fresh interpreter of this environment."""
    return _run_python


@pytest.fixture(scope="module")
def multi_turn_generator(tiny_model_dir):
    """The hf generator on the tiny model, room for 256 tokens (a module's multi-turn rollouts)."""
    from rlcore.loading.loader import build_config
    from rlcore.generation.hf_generator import HFGenerator

    config = build_config({"policy": {"model_name": str(tiny_model_dir), "generation": {"backend": "hf"}}})
    return HFGenerator(str(tiny_model_dir), config.section("policy.generation"), 256)


@pytest.fixture
def outside_dir(tmp_path):
    """A directory beside the one under test, holding ``keep.txt``: what a symbolic link points at
    that nothing under test may delete, write or read."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep me")
    return outside
