"""interpreter.py: the garbage collector's pauses and policy, and the interpreter lock's waits."""

import gc
import itertools
import threading
import time

from rlcore.controller.interpreter import CollectorPolicy, GCClock, LockLagProbe


def test_gc_clock_counts_collections_while_entered_and_resets_on_take():
    automatic = gc.isenabled()
    gc.disable()  # only the three collections below: the 20,000 lists could trigger one more, depending on the heap
    try:
        with GCClock() as clock:
            for _ in range(3):
                cycles = [[] for _ in range(20_000)]
                for a, b in itertools.pairwise(cycles):
                    a.append(b)
                    b.append(a)
                del cycles
                gc.collect()  # a full collection (generation 2)
            taken = clock.take()
            assert taken["time/gc_full_collections"] == 3
            assert taken["time/gc_s"] >= taken["time/gc_longest_s"] > 0
            assert clock.take() == {"time/gc_s": 0.0, "time/gc_longest_s": 0.0, "time/gc_full_collections": 0.0}
    finally:
        if automatic:
            gc.enable()
    gc.collect()
    assert clock.take()["time/gc_full_collections"] == 0 and clock._on_collection not in gc.callbacks


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the garbage collector frees it


def _cycle_freed_inside(enabled: bool) -> tuple[bool, bool]:
    import weakref

    before = _Node()
    alive = weakref.ref(before)
    with CollectorPolicy(period=1 if enabled else 0):
        del before
        gc.collect()
        freed_inside = alive() is None
    gc.collect()
    return freed_inside, alive() is None


def test_setup_objects_are_out_of_the_collectors_reach_until_the_run_ends():
    gc.unfreeze()  # a vLLM engine started in this process by another test freezes its heap
    assert _cycle_freed_inside(enabled=True) == (False, True)  # frozen with the setup, freed once unfrozen
    assert _cycle_freed_inside(enabled=False) == (True, True)
    assert gc.get_freeze_count() == 0


def test_gc_period_collects_only_after_every_nth_steps_training():
    import weakref

    with CollectorPolicy(period=2) as policy, GCClock() as clock:  # the clock after the setup's collection
        node = _Node()
        alive = weakref.ref(node)
        del node
        kept = [[[]] for _ in range(50_000)]  # far past the automatic thresholds
        assert alive() is not None and clock.take()["time/gc_full_collections"] == 0 and len(kept) == 50_000
        policy.after_training(step=1)
        assert alive() is not None and clock.take()["time/gc_full_collections"] == 0
        policy.after_training(step=2)
        assert alive() is None and clock.take()["time/gc_full_collections"] == 1
    assert gc.isenabled() and gc.get_freeze_count() == 0  # restored


def test_gc_period_0_changes_nothing():
    gc.unfreeze()
    with CollectorPolicy(period=0) as policy:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        policy.after_training(step=1)
    assert gc.isenabled()


def _hold_the_lock(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # pure Python: keeps the interpreter lock but for forced switches
        pass


def test_lock_lag_probe_sees_a_thread_that_keeps_the_interpreter_lock():
    import sys

    switch = sys.getswitchinterval()
    with LockLagProbe(enabled=True) as probe:
        time.sleep(0.2)
        idle = probe.take()
        sys.setswitchinterval(0.05)  # a holder that gives the lock up every 50 ms at most
        try:
            busy = threading.Thread(target=_hold_the_lock, args=(0.5,))
            busy.start()
            busy.join()
        finally:
            sys.setswitchinterval(switch)
        loaded = probe.take()
    assert idle["time/gil_lag_mean_s"] < 0.01, idle
    assert loaded["time/gil_lag_max_s"] > 0.04, loaded
    assert LockLagProbe(enabled=False).take() == {}



def _collections_while_a_loop_thread_allocates(period: int) -> int:
    """Collections of any generation while an event loop on its own thread (as the async vLLM engine's
    front end runs) makes objects at a high rate, inside ``CollectorPolicy(period)``."""
    import asyncio

    seen = []

    def count(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    async def engine_like_outputs():
        kept = []
        for _ in range(200):
            kept.append([{"token_ids": [i], "logprobs": [0.0]} for i in range(500)])  # per request, per engine step
            await asyncio.sleep(0)
        return len(kept)

    with CollectorPolicy(period=period):
        gc.callbacks.append(count)
        try:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="engine-loop", daemon=True)
            thread.start()
            assert asyncio.run_coroutine_threadsafe(engine_like_outputs(), loop).result(timeout=60) == 200
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
        finally:
            gc.callbacks.remove(count)
    return len(seen)


def test_gc_period_keeps_automatic_collections_off_every_thread_of_the_process():
    gc.unfreeze()
    assert _collections_while_a_loop_thread_allocates(period=0) > 0  # 300,000 containers: many automatic ones
    assert _collections_while_a_loop_thread_allocates(period=1) == 0  # none until the step's own collection
