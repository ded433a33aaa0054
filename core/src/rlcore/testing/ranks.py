"""Multi-process tests: one worker process per rank, all waited for, none left behind.

``run_ranks`` starts ``sys.executable WORKER rank world_size *args`` for each rank with the given
environment, waits for all of them within ``timeout`` seconds, and fails the test naming ``what`` with
each rank's output tail when one exits non-zero (ending the others at once) or the time runs out. The workers
rendezvous themselves (a port in ``args``); results come back through files the caller reads.
``rank_results`` is the common case: a fresh port first, quiet single-threaded workers, and the
JSON file they leave.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def run_ranks(worker: Path, args: Sequence[str], *, what: str, timeout: float, world_size: int = 2,
              env: dict[str, str] | None = None) -> list[str]:
    """Each rank's combined stdout and stderr, after every rank exited 0. A rank that fails ends the
    others at once (they would wait for it until their own timeouts), and the test fails with every
    rank's output; so does ``timeout``."""
    import pytest

    with contextlib.ExitStack() as files:
        outputs = [files.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(world_size)]
        procs = [subprocess.Popen([sys.executable, str(worker), str(rank), str(world_size), *map(str, args)], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, text=True) for rank, out in enumerate(outputs)]
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in procs]  # every one, each time: a failed rank is noticed at once
                if None not in codes or any(codes) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            still_running = [rank for rank, p in enumerate(procs) if p.poll() is None]
            for rank in still_running:
                procs[rank].kill()
                procs[rank].wait()
        logs = []
        for out in outputs:
            out.seek(0)
            logs.append(out.read())
    exited = {rank: p.returncode for rank, p in enumerate(procs) if rank not in still_running and p.returncode}
    if exited or still_running:
        reason = "; ".join([f"rank {rank} exited with {code}" for rank, code in exited.items()]
                           + [f"rank {rank} stopped" + ("" if exited else f" after {timeout:.0f} s")
                              for rank in still_running])
        pytest.fail(f"{what} failed ({reason}):\n" + "\n".join(f"--- rank {r}\n{log[-4000:]}" for r, log in enumerate(logs)))
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
