"""The example third-party plugin (examples/toy_env_plugin) is found once installed, with no
change to rlcore, and passes the environment conformance suite in its own test run.

It is installed with pip (a real wheel build, a real ``.dist-info`` with ``entry_points.txt``)
into a temporary ``--target`` directory that the subprocesses below get on ``PYTHONPATH``.
That is the discovery path of an install into site-packages (importlib.metadata scans every
``sys.path`` entry the same way), without changing the shared environment: an install into the
venv itself would leak into every other test and stay behind if this one were interrupted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "toy_env_plugin"
BIN = Path(sys.executable).parent


def _env(site: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_") and k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return dict(env, COLUMNS="250", NO_COLOR="1")


def _run(args: list[str], site: Path | None, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=_env(site), cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(site directory holding the installed plugin, a copy of the example's source tree)."""
    root = tmp_path_factory.mktemp("toy-plugin")
    source = root / "src-copy"  # build from a copy: setuptools writes build/ and egg-info beside the sources
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    result = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                   "--disable-pip-version-check", "--quiet", "--target", str(site), str(source)], None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(site.glob("rlcore_toy_env-0.1.0.dist-info/entry_points.txt"))
    return site, source


def _plugins(site: Path | None) -> dict[str, dict]:
    result = _run([str(BIN / "rlcore"), "plugins", "--json"], site)
    assert result.returncode == 0, result.stderr
    return {d["distribution"]: d for d in json.loads(result.stdout)}


def test_installed_plugin_is_listed(installed):
    site, _ = installed
    listed = _plugins(site)
    toy = listed["rlcore-toy-env"]
    assert toy["version"] == "0.1.0"
    assert toy["entry_points"] == ["toy_env = rlcore_toy_env.plugin"]
    (env,) = toy["provides"]["environment"]
    assert env == {"name": "toy_echo", "section": "env.toy_echo", "config": "rlcore_toy_env.config.ToyEchoConfig",
                   "capabilities": {"multi_turn": False, "devices": ["cpu"]}}
    # The repository's own plugins are still there next to it.
    assert {"rlcore", "rlcore-fsdp2", "rlcore-megatron", "rlcore-vllm", "rlcore-math"} <= set(listed)


def test_shared_environment_is_unchanged(installed):
    assert "rlcore-toy-env" not in _plugins(None)


def test_plugin_section_is_validated(installed, tmp_path):
    site, _ = installed
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"policy": {"model_name": "m"}, "env": {"name": "toy_echo"}}))
    rlcore = str(BIN / "rlcore")
    result = _run([rlcore, "config", str(recipe), "env.toy_echo.case_sensitive=true", "--json"], site)
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)["env"]
    assert resolved["name"] == "toy_echo"
    assert resolved["toy_echo"] == {"case_sensitive": True, "reward_correct": 1.0, "reward_wrong": 0.0, "max_chars": 1000}
    result = _run([rlcore, "config", str(recipe), "env.toy_echo.case_sensitiv=true"], site)
    assert result.returncode == 2
    assert "config key 'env.toy_echo.case_sensitiv': unknown key; did you mean 'env.toy_echo.case_sensitive'?" in result.stderr
    result = _run([rlcore, "config", str(recipe), "env.toy_echo.max_chars=0"], site)
    assert result.returncode == 2 and "env.toy_echo.max_chars" in result.stderr


def test_plugin_passes_environment_conformance(installed):
    site, source = installed
    tests = source / "tests"
    result = _run([sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "--rootdir", str(source)],
                  site, cwd=source)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    # Against the installed copy, not the repository's sources.
    where = _run([sys.executable, "-c", "import rlcore_toy_env; print(rlcore_toy_env.__file__)"], site)
    assert where.stdout.strip().startswith(str(site))
    summary = result.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 9, summary
