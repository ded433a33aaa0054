"""The sandbox's host side reads a solution's output in bounded memory; needs no bwrap (the reading is
the host's, whatever process writes)."""

from __future__ import annotations

import subprocess
import sys

FLOOD = """
import os, resource, subprocess, sys
from rlcore_envs.sandbox import communicate_bounded
child = ("import os, sys\\nblock = b'x' * (1 << 20)\\nsys.stdin.read()\\n"
         "for _ in range(400):\\n    os.write(1, block)\\n    os.write(2, block)\\nos.write(2, b'the end')\\n")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, start_new_session=True)
out, err, timed_out = communicate_bounded(proc, b"job" * 100000, 60, 1 << 20)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(len(out), len(err), err.endswith(b"the end"), timed_out, grown)
"""


def test_a_flood_of_output_is_read_in_bounded_memory():
    """400 MiB on each of stdout and stderr (written to the file descriptors, past any redirection
    of sys.stdout): the first max_output_bytes and the stderr's tail are kept, the rest read and
    dropped as it comes. Without a sandbox: the reading is the host's."""
    done = subprocess.run([sys.executable, "-c", FLOOD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out_len, err_len, tail, timed_out, grown_kib = done.stdout.split()
    assert (int(out_len), int(err_len), tail, timed_out) == (1 << 20, 4000, "True", "False")
    assert int(grown_kib) < 100 * 1024, f"the reader grew by {int(grown_kib) >> 10} MiB for 800 MiB of output"
