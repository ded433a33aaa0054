"""GCClock: the garbage collector's pauses as each step's record gives them."""

import gc

from rlcore.controller.gc_pauses import GCClock, setup_objects_frozen


def test_gc_clock_counts_collections_while_entered_and_resets_on_take():
    with GCClock() as clock:
        for _ in range(3):
            cycles = [[] for _ in range(20_000)]
            for a, b in zip(cycles, cycles[1:]):
                a.append(b)
                b.append(a)
            del cycles
            gc.collect()  # a full collection (generation 2)
        taken = clock.take()
        assert taken["time/gc_full_collections"] == 3
        assert taken["time/gc_s"] >= taken["time/gc_longest_s"] > 0
        assert clock.take() == {"time/gc_s": 0.0, "time/gc_longest_s": 0.0, "time/gc_full_collections": 0.0}
    gc.collect()
    assert clock.take()["time/gc_full_collections"] == 0 and clock._on_collection not in gc.callbacks


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the garbage collector frees it


def _cycle_freed_inside(enabled: bool) -> tuple[bool, bool]:
    import weakref

    before = _Node()
    alive = weakref.ref(before)
    with setup_objects_frozen(enabled):
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
