"""Runs rlcore's TrainingBackendConformance against the megatron backend in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from rlcore.testing.conformance import TrainingBackendConformance


def test_megatron_backend_passes_conformance():
    suite = Path(__file__).with_name("conformance_megatron.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-q", "-x", "-p", "no:cacheprovider"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # Every test of the suite ran and passed: none skipped or deselected, however many it has.
    expected = sum(1 for name in dir(TrainingBackendConformance) if name.startswith("test_"))
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{expected} passed\b", summary) and "skipped" not in summary, proc.stdout[-2000:]
