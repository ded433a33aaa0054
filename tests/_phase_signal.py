"""``rlcore run`` (the CLI's own ``main``) that holds at one phase of one step until SIGTERM arrives,
for tests/test_first_hour.py's phase test.

    python _phase_signal.py PHASE STEP MARKER -- run RECIPE OVERRIDE...

The phase is the run's own: the step timer's (:class:`rlcore.controller.timing.StepTimer`). On the
first entry into ``PHASE`` of the ``STEP``-th step timer that enters it, this writes ``MARKER`` and
waits, inside the phase, until the run's SIGTERM handler has taken the signal; then the phase's
own work goes on. The test sends the signal once ``MARKER`` exists: the run is in that phase when it
arrives, known for sure.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from rlcore.controller import timing
from rlcore.controller.checkpoint import TERMINATED

HOLD_AT_MOST_S = 300  # the test's own deadline for sending the signal is shorter


def hold_at(phase: str, step: int, marker: Path) -> None:
    original = timing.StepTimer.phase
    entered: list = []  # the step timers that entered ``phase``, in order (one a step)

    @contextlib.contextmanager
    def phase_then_hold(self, name: str):
        with original(self, name):
            if name == phase and not any(t is self for t in entered):
                entered.append(self)
                if len(entered) == step:
                    marker.write_text(f"{phase} of step {step}\n")
                    until = time.monotonic() + HOLD_AT_MOST_S
                    while not TERMINATED.is_set() and time.monotonic() < until:
                        time.sleep(0.01)  # the main thread's handler runs between these sleeps
            yield

    timing.StepTimer.phase = phase_then_hold


if __name__ == "__main__":
    phase, step, marker, dashes, *argv = sys.argv[1:]
    assert dashes == "--", sys.argv
    hold_at(phase, int(step), Path(marker))
    from rlcore.cli.commands import main

    sys.argv = ["rlcore", *argv]  # the program's own command line: main() as the rlcore script runs it
    sys.exit(main())
