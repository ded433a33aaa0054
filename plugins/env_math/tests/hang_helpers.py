"""Grade functions that misbehave on purpose, imported by spawned grader workers in tests.

``blocking_grade`` stands for a verification stuck inside C code (where the signal deadline
cannot reach); ``crashing_grade`` for a worker the OS kills.
"""

from __future__ import annotations

import os
import signal
import time

from rlcore_math.grading import grade_text


def blocking_grade(text, gold, **kwargs):
    if text == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(120)
    return grade_text(text, gold, **kwargs)


def crashing_grade(text, gold, **kwargs):
    if text == "crash":
        os._exit(3)
    return grade_text(text, gold, **kwargs)
