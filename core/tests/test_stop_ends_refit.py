"""A stop signal (SIGTERM, Ctrl-C) ends the step's refit: its weights are for a step that will not
run, and a part the signal ended too (vLLM's engine, in the process group) would keep the refit
waiting until cluster.timeout_s, with the step's training, done already, not yet checkpointed.
Here the wait is a lock that is never released (as vLLM's ``collective_rpc`` waits on a reply
from a dead engine); the signal is this process's own, sent from another thread."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rlcore.controller.checkpoint import StopSignalled, ended_by_stop, run_catching_sigterm


class _Loop:
    step, stop_signal = 2, None


def _signal_soon(signum: int, after_s: float = 0.2) -> None:
    threading.Timer(after_s, os.kill, (os.getpid(), signum)).start()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_a_wait_on_a_part_that_never_answers(signum):
    loop, never = _Loop(), threading.Lock()
    never.acquire()

    def body() -> str:
        with ended_by_stop(loop):
            _signal_soon(signum)
            never.acquire(timeout=60)  # the refit's call into an engine that died with the signal
        return "waited"

    started = time.monotonic()
    with pytest.raises(StopSignalled, match=f"{signal.Signals(signum).name} received during the step's refit"):
        run_catching_sigterm(loop, body)
    assert time.monotonic() - started < 30 and loop.stop_signal == signum


def test_a_stop_signal_that_came_before_skips_the_refit_and_one_outside_it_waits_for_the_step():
    loop = _Loop()

    def body() -> list[str]:
        done = []
        _signal_soon(signal.SIGTERM, after_s=0.0)
        time.sleep(0.5)  # training: the signal is recorded, the work goes on
        done.append("trained")
        try:
            with ended_by_stop(loop):
                done.append("refitted")
        except StopSignalled:
            done.append("refit skipped")
        return done

    assert run_catching_sigterm(loop, body) == ["trained", "refit skipped"]
    assert loop.stop_signal == signal.SIGTERM


def test_a_ctrl_c_of_an_earlier_run_in_the_process_is_not_taken_for_a_later_runs(tmp_path, capsys):
    """``rlcore run`` reads the interruption flags to report an error that follows a signal as the stop it was;
    a later run in the same process (a sweep, a notebook) had none: its bad key is an error, exit 2."""
    from rlcore.cli.commands import main
    from rlcore.controller.checkpoint import INTERRUPTED

    INTERRUPTED.set()  # what a Ctrl-C'd run before this one left
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("policy:\n  model_name: /nonexistent\n  sequence_packing: {enabled: true, train_mb_tokens: 1}\n")
    assert main(["run", str(recipe)]) == 2
    assert "interrupted" not in capsys.readouterr().err
