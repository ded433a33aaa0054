"""The colocated engine's wake-up in two halves: the weights before a refit, the KV cache after it.

A refit's chunks (and a LoRA merge's float32 buffers) must not compete with the KV cache for memory:
an 8B LoRA run on an 80 GB GPU ran out of memory merging adapters while the KV cache was mapped. The
engine here records the calls and keeps a GPU's free memory (an injected fault of the device's
count, the only stand-in: vLLM has no sleep mode on the CPU; the real engine's tagged wake-up runs
in the CUDA tests' GRPO steps).
"""

from __future__ import annotations

import sys
import types

import pytest

from rlcore.config import structure
from rlcore.generation import staged_wake
from rlcore_vllm.config import VllmConfig
from rlcore_vllm.generator import VllmGenerator

GIB = 1 << 30


class Device:
    """A GPU's free memory and torch's allocator cache (``empty_cache`` returns it)."""

    def __init__(self, free: int):
        self.free, self.cached, self.events = free, 0, []

    def empty_cache(self):
        self.events.append("empty_cache")
        self.free, self.cached = self.free + self.cached, 0


class Engine:
    in_process = True

    def __init__(self, device: Device, weights: int, cache: int):
        self.device, self.parts, self.asleep = device, {"weights": weights, "kv_cache": cache}, set()

    def sleep(self, level):
        self.device.events.append("sleep")
        for tag, size in self.parts.items():
            if tag not in self.asleep:
                self.device.free += size
        self.asleep = set(self.parts)

    def wake_up(self, tags=None):
        assert tags is not None, "the generator wakes the engine by halves"
        for tag in tags:
            assert tag in self.asleep, f"{tag} is not asleep"
            assert self.device.free >= self.parts[tag], f"out of memory mapping {tag}"
            self.device.free -= self.parts[tag]
            self.asleep.discard(tag)
        self.device.events.append(f"wake {'+'.join(tags)}")

    def rpc(self, method, *args):
        self.device.events.append(method)
        if method == "rlcore_load":  # the chunk's buffers (a LoRA merge's temporaries) come from the GPU
            assert "kv_cache" in self.asleep, "a refit's chunk was loaded with the KV cache mapped"
        return [None]

    def reset_prefix_cache(self):
        pass

    def run(self, requests):
        assert not self.asleep, f"generating with {sorted(self.asleep)} asleep"
        self.device.events.append("generate")
        return []


@pytest.fixture
def colocated(monkeypatch):
    device = Device(free=80 * GIB)
    monkeypatch.setattr(staged_wake, "free_gpu_bytes", lambda: device.free)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        empty_cache=device.empty_cache, mem_get_info=lambda: (device.free, 80 * GIB),
        memory_allocated=lambda: 0, memory_reserved=lambda: device.cached))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    gen = VllmGenerator.__new__(VllmGenerator)
    gen.config = structure(VllmConfig, {}, "policy.generation")
    gen.device, gen.model_path, gen.max_model_len, gen.image_token = "cuda", "/model", 64, None
    gen.memory_fraction = gen.config.engine_memory_fraction(None)
    gen.sleeping, gen.weights_version = False, 0
    gen._start_staged_wake()
    device.free -= 50 * GIB  # the engine: 16 GiB of weights, 34 of KV cache
    gen.engine = Engine(device, weights=16 * GIB, cache=34 * GIB)
    return gen, device


class Chunk:
    """An encoded chunk whose release gives its memory back to the allocator's cache."""

    def __init__(self, device, size):
        self.device, self.size, self.payload = device, size, {"chunk": size}
        device.free -= size

    def release(self):
        self.device.cached += self.size


def test_refit_loads_with_the_cache_asleep_then_maps_it_after_the_chunks_are_gone(colocated, monkeypatch):
    gen, device = colocated
    gen.sleep()
    assert gen._wake_bytes == 50 * GIB and device.free == 80 * GIB
    device.free -= 20 * GIB  # the trainer keeps 20 GiB: 60 free, 50 needed
    gen.wake_up()
    assert gen.engine.asleep == {"kv_cache"} and gen._cache_bytes == 34 * GIB
    # Three 4 GiB chunks while the KV cache's 34 GiB stay unmapped: 44 - 12 = 32 free during the load,
    # less than the cache needs, so the old order (cache first) would have run out of memory.
    import rlcore_vllm.codecs as codecs

    monkeypatch.setattr(codecs, "encode", lambda chunk, how: Chunk(device, 4 * GIB))
    gen.update_weights([[("w", object())]] * 3)
    assert device.events == ["sleep", "wake weights", "rlcore_begin_update", "rlcore_load", "rlcore_load", "rlcore_load",
                             "rlcore_finish_update", "empty_cache", "wake kv_cache"]
    assert not gen.engine.asleep and gen.weights_version == 1 and device.free == 10 * GIB


def test_a_wake_up_no_refit_follows_maps_the_cache_at_the_first_generation(colocated):
    gen, device = colocated
    gen.sleep()
    gen.wake_up()
    assert gen.engine.asleep == {"kv_cache"}
    gen._check_awake()  # what every generation and scoring call does first
    gen.engine.run([])
    assert device.events[-3:] == ["empty_cache", "wake kv_cache", "generate"]


def test_sleeping_again_before_any_generation_sleeps_the_whole_engine(colocated):
    """vLLM sleeps only a whole engine (a half-awake one ignores sleep): the cache is mapped first."""
    gen, device = colocated
    gen.sleep()
    gen.wake_up()
    gen.sleep()
    assert gen.engine.asleep == {"weights", "kv_cache"} and gen._wake_bytes == 50 * GIB and device.free == 80 * GIB


def test_the_cache_half_refused_names_the_cache_and_what_the_trainer_holds(colocated):
    gen, device = colocated
    gen.sleep()
    device.free -= 20 * GIB
    gen.wake_up()  # 60 free >= 50: weights mapped, 44 left
    device.free -= 15 * GIB  # something else took memory before generation: 29 free < 34
    with pytest.raises(MemoryError, match=r"its KV cache needs 34\.0 GiB and the GPU has 29\.0 of 80\.0 GiB free"):
        gen._check_awake()
    assert gen.engine.asleep == {"kv_cache"}  # nothing mapped midway


def test_the_whole_wake_up_refused_before_anything_is_mapped(colocated):
    gen, device = colocated
    gen.sleep()
    device.free -= 40 * GIB  # 40 free < 50
    with pytest.raises(MemoryError, match=r"its weights and KV cache need 50\.0 GiB"):
        gen.wake_up()
    assert gen.engine.asleep == {"weights", "kv_cache"} and gen.sleeping


def _shut_down_as(gen):
    """The engine's state when the generator shuts it down."""
    seen, engine = {}, gen.engine
    engine.shutdown = lambda: seen.setdefault("asleep", set(engine.asleep))
    gen.shutdown()
    return seen["asleep"]


def test_an_engine_asleep_at_the_end_is_woken_then_shut_down(colocated):
    """vLLM's pool freed asleep unmaps again what its sleep unmapped (a CUDA error as every run ends): the
    generator wakes both halves first, once the trainer has shut down and given its memory back."""
    gen, device = colocated
    gen.sleep()
    assert _shut_down_as(gen) == set() and gen.engine is None
    assert device.events[-3:] == ["wake weights", "empty_cache", "wake kv_cache"]


def test_an_engine_half_awake_at_the_end_maps_its_cache_then_shuts_down(colocated):
    gen, device = colocated
    gen.sleep()
    gen.wake_up()  # weights only: a refit that never came
    assert _shut_down_as(gen) == set()


def test_an_engine_with_no_room_to_wake_is_shut_down_asleep(colocated):
    gen, device = colocated
    gen.sleep()
    device.free -= 40 * GIB  # the trainer still holds its memory: 40 free < 50
    assert _shut_down_as(gen) == {"weights", "kv_cache"}


def test_an_engine_that_cannot_wake_at_all_is_still_shut_down(colocated):
    gen, device = colocated
    gen.sleep()

    def dead(tags=None):
        raise RuntimeError("EngineCore encountered an issue")

    gen.engine.wake_up = dead
    assert _shut_down_as(gen) == {"weights", "kv_cache"}


def test_an_awake_engine_is_shut_down_with_no_wake_up(colocated):
    gen, device = colocated
    assert _shut_down_as(gen) == set() and device.events == []
