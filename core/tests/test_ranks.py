"""rlcore.testing.ranks: a failing rank ends its peers at once and the test fails with every rank's
output; and the ports tests rendezvous on come from outside the kernel's ephemeral range."""

from __future__ import annotations

import time

import pytest

from rlcore.testing.ranks import run_ranks
from rlcore.utils import _ephemeral_ports_start, free_port

# the tests bound run_ranks by seconds of wall clock: they run in make test's wall_clock phase
pytestmark = pytest.mark.wall_clock

WORKER = """
import sys, time
rank = int(sys.argv[1])
print(f"rank {rank} started", flush=True)
if rank == 1:
    sys.exit(3)
time.sleep(120)  # a peer waiting for the failed rank
"""


def test_a_failing_rank_ends_the_others_with_every_rank_output(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"toy ranks failed \(rank 1 exited with 3; rank 0 stopped\)") as failure:
        run_ranks(worker, [], what="toy ranks", timeout=100)
    assert time.monotonic() - start < 60  # not the sleeping peer's 120 s, nor the timeout
    assert "rank 0 started" in str(failure.value) and "rank 1 started" in str(failure.value)


def test_ranks_still_running_at_the_timeout_are_stopped(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text("import time; time.sleep(120)\n")
    with pytest.raises(pytest.fail.Exception, match=r"rank 0 stopped after 2 s; rank 1 stopped after 2 s"):
        run_ranks(worker, [], what="toy ranks", timeout=2)


def test_free_ports_come_from_below_the_ephemeral_range():
    ports = {free_port() for _ in range(20)}
    assert all(20_000 <= port < _ephemeral_ports_start() for port in ports)
    assert len(ports) > 1  # drawn at random, not one fixed port
