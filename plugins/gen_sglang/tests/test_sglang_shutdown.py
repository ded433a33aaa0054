"""A colocated SGLang engine shut down while it sleeps is woken first (both halves) where the GPU has room: a memory
saver that frees a paused allocation can release its memory handle twice, as vLLM's pool did at the end of every
colocated run. The engine here records the calls and keeps a GPU's free memory (an injected fault of the device's
count, the only stand-in: SGLang runs on CUDA only; the real engine's release and resume run in its CUDA tests)."""

from __future__ import annotations

import sys
import types

import pytest

from rlcore.generation import staged_wake
from rlcore_sglang import engine as engine_module
from rlcore_sglang import generator as generator_module
from rlcore_sglang.config import SglangConfig
from rlcore_sglang.generator import SglangGenerator

GIB = 1 << 30


class Device:
    def __init__(self, free: int):
        self.free, self.events = free, []


class Engine:
    """SGLang's engine thread: each tag released or resumed moves its bytes; resuming one not released fails, as
    SGLang's does."""

    def __init__(self, device: Device, parts: dict[str, int]):
        self.device, self.parts, self.released = device, parts, set()
        self.fail_resume = False

    def memory(self, action: str, tags: list[str]) -> None:
        for tag in tags:
            if action == "release":
                assert tag not in self.released, f"{tag} released twice"
                self.device.free += self.parts[tag]
                self.released.add(tag)
            else:
                if self.fail_resume:
                    raise RuntimeError("the engine's scheduler is gone")
                assert tag in self.released, f"{tag} is not released"
                assert self.device.free >= self.parts[tag], f"out of memory mapping {tag}"
                self.device.free -= self.parts[tag]
                self.released.discard(tag)
            self.device.events.append(f"{action} {tag}")

    def shutdown(self) -> None:
        self.device.events.append(f"shutdown with {sorted(self.released) or 'nothing'} released")


@pytest.fixture
def colocated(monkeypatch):
    device = Device(free=40 * GIB)
    engines = []

    def start(args):
        engines.append(Engine(device, {"weights": 3 * GIB, "kv_cache": 20 * GIB}))
        return engines[-1]

    monkeypatch.setattr(engine_module, "EngineThread", start)
    monkeypatch.setattr(generator_module, "_vocab_size", lambda path: 128)
    monkeypatch.setattr(staged_wake, "free_gpu_bytes", lambda: device.free)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=types.SimpleNamespace(
        empty_cache=lambda: None, mem_get_info=lambda: (device.free, 80 * GIB),
        memory_allocated=lambda: 0, memory_reserved=lambda: 0)))
    monkeypatch.setattr(SglangGenerator, "_memory", lambda self, action, tags: self.engine.memory(action, tags))
    gen = SglangGenerator("/model", SglangConfig(), memory_fraction=0.3)
    assert gen._sleeps  # colocated, sleep level 1: the defaults
    return gen, engines[0], device


def test_an_engine_asleep_is_woken_then_shut_down(colocated):
    gen, engine, device = colocated
    gen.sleep()
    gen.shutdown()
    assert device.events == ["release weights", "release kv_cache", "resume weights", "resume kv_cache",
                             "shutdown with nothing released"]
    assert gen.engine is None


def test_an_engine_half_awake_maps_its_cache_then_shuts_down(colocated):
    gen, engine, device = colocated
    gen.sleep()
    gen.wake_up()  # the weights, before a refit; the KV cache would follow the refit
    gen.shutdown()
    assert device.events[-2:] == ["resume kv_cache", "shutdown with nothing released"]


def test_with_no_room_the_engine_is_shut_down_asleep(colocated):
    gen, engine, device = colocated
    gen.sleep()
    device.free = 2 * GIB  # what the trainer's memory left: less than the engine gave back
    gen.shutdown()
    assert device.events[-1] == "shutdown with ['kv_cache', 'weights'] released"


def test_an_engine_that_cannot_wake_is_still_shut_down(colocated):
    gen, engine, device = colocated
    gen.sleep()
    engine.fail_resume = True
    gen.shutdown()
    assert device.events[-1] == "shutdown with ['kv_cache', 'weights'] released" and gen.engine is None


def test_an_engine_awake_is_shut_down_as_it_is(colocated):
    gen, engine, device = colocated
    gen.shutdown()
    assert device.events == ["shutdown with nothing released"]
