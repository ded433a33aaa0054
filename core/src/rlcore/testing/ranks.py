"""Multi-process tests: one worker process per rank, all waited for, none left behind.

``run_ranks`` starts ``sys.executable WORKER rank world_size *args`` for each rank with the given
environment, waits for all of them within ``timeout`` seconds, kills any still running, and fails
the test naming ``what`` with each rank's output tail when one exits non-zero. The workers
rendezvous themselves (a port in ``args``); results come back through files the caller reads.
"""

from __future__ import annotations

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
