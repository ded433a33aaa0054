"""Every command in the fenced blocks of README.md and the getting-started page that runs on a CPU
runs, in the order they are written, as a reader would type it after ``make demo``.

Which blocks run: ``bash`` blocks line by line (a line ending in ``\\`` continues) and ``python``
blocks as a script; ``text`` blocks are output and never run. A block preceded by a
``<!-- readme-test: skip, REASON -->`` line (installs, demo-length runs, GPU-only recipes, the hub) is
reported as skipped with that reason. Each command runs in a scratch directory holding the
repository's ``recipes/`` and ``examples/`` and a ``runs/demo/sft`` model of the demo's shape
(random weights, not the warm start: these commands must run, not learn). To stay cheap, every
``rlcore run`` gets the overrides in ``SMALL`` appended (later overrides win), and a ``python``
block's ``rlcore.load_config`` calls get them too (a two-line shim put before the block), so a run
takes one small step without validation; the README's own commands pick the ``hf`` generator, the
getting-started page's get it appended (``PAGE_SMALL``). The ``rlcore`` commands run in processes forked
from a server that imported the libraries once (``_preloaded_cli``), each with its own exit status.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _preloaded_cli import PreloadedCli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "getting-started.md")
SKIP = re.compile(r"<!--\s*readme-test:\s*skip,\s*(.*?)\s*-->")
SMALL = ["train.max_num_steps=1", "train.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2",
         "train.val_period=0", "train.val_at_start=false", "logger.plot=false"]
# The getting-started page's runs use the recipe's vLLM generator: here the hf one (the same loop; a vLLM
# engine's start per command would cost minutes, and tests/test_first_hour.py runs the recipe on vLLM).
PAGE_SMALL = {"README": SMALL, "getting-started": [*SMALL, "policy.generation.backend=hf"]}


def shim(small: list[str] = SMALL) -> str:
    """Two lines put before a python block: its ``rlcore.load_config`` calls get ``small`` appended."""
    return (f"import rlcore\n_load = rlcore.load_config\n"
            f"rlcore.load_config = lambda path, overrides=(), **kw: _load(path, [*overrides, *{small!r}], **kw)\n")


SHIM = shim()


def blocks(page: Path = README) -> list[tuple[str, str, str | None]]:
    """``(language, body, skip reason)`` of each fenced block of ``page``, in order."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)", lines[i])
        if not m:
            i += 1
            continue
        reason = None
        for back in range(i - 1, -1, -1):
            if lines[back].strip():
                skip = SKIP.search(lines[back])
                reason = skip.group(1) if skip else None
                break
        end = lines.index("```", i + 1)
        found.append((m.group(1), "\n".join(lines[i + 1:end]), reason))
        i = end + 1
    return found


def commands(body: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


RUNNABLE = [b for b in blocks() if b[0] in ("bash", "python")]
PAGE_BLOCKS = [(page, *b) for page in PAGES for b in blocks(page) if b[0] in ("bash", "python")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from rlcore.cli.demo import MODEL_SHAPES
    from rlcore.testing.tiny import build_tiny_model

    work = tmp_path_factory.mktemp("readme")
    for name in ("recipes", "examples"):
        (work / name).symlink_to(ROOT / name)
    for name, seed in (("sft", 0), ("base", 1)):  # the demo's warm start and the model it starts from
        build_tiny_model(work / "runs" / "demo" / name, "llama", seed=seed, **MODEL_SHAPES["tiny"])
    return work


@pytest.fixture(scope="module")
def preloaded(tmp_path_factory):
    """The fork server the ``rlcore`` commands run from, and a directory for their output."""
    cli = PreloadedCli()
    yield cli, tmp_path_factory.mktemp("readme-output")
    cli.close()


def _run(argv: list[str], cwd: Path, preloaded) -> None:
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONWARNINGS="ignore",
               RLCORE_DISABLE_PLUGINS=os.environ.get("RLCORE_DISABLE_PLUGINS", ""))
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):  # a shell's leading VAR=value
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    if argv and argv[0] == "python":  # the reader's python is the environment's
        argv = [sys.executable, *argv[1:]]
    if argv and argv[0] == "rlcore":  # the environment's script: the CLI's main on this command line
        cli, output = preloaded
        result = cli.run_cli(argv[1:], env, output, timeout=300, cwd=cwd)
    else:
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{shlex.join(argv)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def test_readme_is_short_and_has_runnable_blocks():
    assert len(README.read_text().splitlines()) <= 200
    assert any(reason is None for _, _, reason in RUNNABLE)


@pytest.mark.parametrize("page, language, body, reason", PAGE_BLOCKS,
                         ids=[f"{p.stem}-block{i}-{lang}" for i, (p, lang, _, _) in enumerate(PAGE_BLOCKS)])
def test_readme_block_runs(page, language, body, reason, workdir, preloaded):
    if reason is not None:
        pytest.skip(f"{page.name} marks it: {reason}")
    small = PAGE_SMALL[page.stem]
    if language == "python":
        script = workdir / "readme_block.py"
        script.write_text(shim(small) + body)
        _run([sys.executable, str(script)], workdir, preloaded)
        return
    for command in commands(body):
        argv = shlex.split(command)
        if argv[:2] == ["rlcore", "run"]:
            argv += small
        _run(argv, workdir, preloaded)
