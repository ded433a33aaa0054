"""Multi-process tests: one worker process per rank, all waited for, none left behind.

``run_ranks`` starts ``sys.executable WORKER rank world_size *args`` for each rank with the given
environment, waits for all of them within ``timeout`` seconds, kills any still running, and fails
the test naming ``what`` with each rank's output tail when one exits non-zero. The workers
rendezvous themselves (a port in ``args``); results come back through files the caller reads.
``rank_results`` is the common case: a fresh port first, quiet single-threaded workers, and the
JSON file they leave.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def run_ranks(worker: Path, args: Sequence[str], *, what: str, timeout: float, world_size: int = 2,
              env: dict[str, str] | None = None) -> list[str]:
    """Each rank's combined stdout and stderr, after every rank exited 0."""
    import pytest

    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), str(world_size), *map(str, args)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world_size)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        pytest.fail(f"{what} failed:\n" + "\n".join(log[-4000:] for log in logs))
    return logs


def rank_results(worker: Path, args: Sequence[str], result: Path, *, what: str, timeout: float) -> dict:
    """:func:`run_ranks` with ``free port, *args`` (warnings off, one OpenMP thread per rank), then the
    JSON the workers wrote to ``result``; the test fails with their output when they wrote none."""
    import pytest

    from rlcore.utils import free_port

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    logs = run_ranks(worker, [str(free_port()), *args], what=what, timeout=timeout, env=env)
    if not Path(result).is_file():
        pytest.fail(f"{what} wrote no results:\n" + "\n".join(log[-4000:] for log in logs))
    return json.loads(Path(result).read_text())
