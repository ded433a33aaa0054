"""Grading called off the main thread (async scoring) with ``executor: inline``: nothing in the
process can interrupt a grader stuck in one C call holding the interpreter lock, so the batch is
graded in a process, and a stuck answer scores ``timeout`` within ``timeout_s + kill_grace_s``
(plus a worker's start-up) instead of holding the whole run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.wall_clock

CODE = textwrap.dedent("""
    import threading
    from rlcore_math.config import GradingConfig
    from rlcore_math.pool import InlineGrader

    if __name__ == "__main__":
        grader = InlineGrader(GradingConfig(num_workers=1, timeout_s=1.0, kill_grace_s=1.0))
        box = {}
        scorer = threading.Thread(target=lambda: box.update(v=grader.grade(["\\\\boxed{9^{9^{9}}}", "\\\\boxed{4}"], ["1", "4"])))
        scorer.start()
        scorer.join()
        print("verdicts", [(v.correct, v.status) for v in box["v"]], flush=True)
        grader.close()
""")


def test_a_grader_stuck_holding_the_interpreter_lock_is_bounded(tmp_path):
    script = tmp_path / "grade_in_a_thread.py"
    script.write_text(CODE)
    # Unfixed, the thread computes 9**387420489 holding the lock: the process never answers.
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "verdicts [(False, 'timeout'), (True, 'ok')]" in done.stdout, done.stdout
    assert "grading in 1 process(es)" in done.stdout
