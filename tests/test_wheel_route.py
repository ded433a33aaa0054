"""The pip route, as a user outside a checkout meets it: ``make wheels`` builds the seven
distributions, they install into a fresh virtual environment, and there, in a directory with no
``recipes/``: the shipped recipes are listed, copied out and found by name; the demo's first steps
run (``python -m rlcore.cli.demo``); and the README's CPU commands run as in
``tests/test_readme_commands.py``.

The environment gets the rlcore distributions from the wheels alone; their dependencies (torch,
transformers, vLLM) come from this test's environment through a ``.pth`` line, which adds its
site-packages to the path without running its ``.pth`` files (so none of its editable rlcore
installs), keeping the test offline and quick.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from test_readme_commands import RUNNABLE, SHIM, SMALL, commands

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("rlcore", "rlcore_fsdp2", "rlcore_megatron", "rlcore_vllm", "rlcore_sglang", "rlcore_math", "rlcore_envs")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheels ``make wheels`` built; returns its bin directory."""
    root = tmp_path_factory.mktemp("wheel-route")
    dist = root / "dist"
    built = subprocess.run(["make", "-C", str(ROOT), "wheels", f"DIST={dist}", f"WHEEL_PYTHON={sys.executable}"],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = sorted(dist.glob("*.whl"))
    assert sorted(w.name.split("-")[0] for w in wheels) == sorted(WHEELS), [w.name for w in wheels]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    # Without this process's PYTHONPATH (a checkout's sources), which pip would take for installed rlcore.
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                "--no-index", "--disable-pip-version-check", *map(str, wheels)],
                               capture_output=True, text=True, timeout=600, env=_env())
    assert installed.returncode == 0, installed.stderr[-3000:]
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "dependencies_of_the_test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python.parent


def _env(bin_dir: Path | None = None) -> dict[str, str]:
    """This process's environment without its source checkout (PYTHONPATH) or rlcore switches;
    ``bin_dir`` first on PATH when given (an activated environment)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("RLCORE_")}
    env.update(PYTHONWARNINGS="ignore", COLUMNS="120", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = os.pathsep.join([*([str(bin_dir)] if bin_dir else []), "/usr/bin", "/bin"])
    return env


def _run(argv: list[str], cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_make_wheels_ships_the_recipes_in_rlcore(venv):
    wheel = next((venv.parent.parent / "dist").glob("rlcore-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        shipped = {Path(n).name for n in zf.namelist() if n.startswith("rlcore/recipes/")}
    assert shipped == {p.name for p in (ROOT / "recipes").rglob("*") if p.is_file()}


def test_the_shipped_recipes_are_listed_copied_out_and_found_by_name(venv, tmp_path):
    env = _env(venv)
    where = _run([str(venv / "python"), "-c", "import rlcore, rlcore_vllm; print(rlcore.__file__, rlcore_vllm.__file__)"],
                 tmp_path, env)
    assert all(path.startswith(str(venv.parent)) for path in where.stdout.split()), where.stdout  # from the wheels
    listed = _run(["rlcore", "recipes", "--json"], tmp_path, env)
    assert "grpo_arith_tiny_cpu" in listed.stdout and "sft_arith_tiny_cpu" in listed.stdout
    _run(["rlcore", "recipes", "grpo_arith_tiny_cpu", "--out", "mine.yaml"], tmp_path, env)
    assert (tmp_path / "mine.yaml").read_text() == (ROOT / "recipes" / "grpo_arith_tiny_cpu.yaml").read_text()
    by_name = _run(["rlcore", "config", "grpo_arith_tiny_cpu", "train.max_num_steps=7", "--json"], tmp_path, env)
    assert '"max_num_steps": 7' in by_name.stdout


def test_the_demos_first_steps_run_from_the_wheels(venv, tmp_path):
    """``python -m rlcore.cli.demo`` outside a checkout: the SFT warm start (to its first evaluation), one
    GRPO step, and the commands to type next, with the environment they need (it is not activated)."""
    done = _run([str(venv / "python"), "-m", "rlcore.cli.demo", "--sft-max-steps", "2", "--sft-eval-every", "1",
                 "--sft-batch-size", "8", "--sft-target", "0", *SMALL, "policy.generation.backend=hf"], tmp_path, _env())
    assert "sft step    1" in done.stdout and "GRPO took" in done.stdout, done.stdout[-3000:]
    assert (tmp_path / "runs" / "demo" / "grpo" / "model" / "config.json").is_file()
    assert f"source {venv}/activate" in done.stdout and "rlcore eval runs/demo/grpo" in done.stdout, done.stdout[-1500:]


@pytest.fixture(scope="module")
def readme_dir(venv, tmp_path_factory) -> Path:
    """A directory with the demo's model and no recipes/ or examples/: the README's commands find the
    recipes in the installed rlcore."""
    work = tmp_path_factory.mktemp("readme-wheels")
    code = ("from rlcore.cli.demo import MODEL_SHAPES; from rlcore.testing.tiny import build_tiny_model; "
            "build_tiny_model('runs/demo/sft', 'llama', seed=0, **MODEL_SHAPES['tiny'])")
    _run([str(venv / "python"), "-c", code], work, _env(venv))
    return work


@pytest.mark.parametrize("language, body, reason", RUNNABLE, ids=[f"block{i}-{b[0]}" for i, b in enumerate(RUNNABLE)])
def test_the_readme_commands_run_from_the_wheels(language, body, reason, venv, readme_dir):
    if reason is not None:
        pytest.skip(f"README marks it: {reason}")
    env = _env(venv)  # `source .venv/bin/activate`, as the README says
    if language == "python":
        script = readme_dir / "readme_block.py"
        script.write_text(SHIM + body)
        _run([str(venv / "python"), str(script)], readme_dir, env)
        return
    for command in commands(body):
        argv = shlex.split(command)
        if argv[:2] == ["rlcore", "run"]:
            argv += SMALL
        _run(argv, readme_dir, env)
