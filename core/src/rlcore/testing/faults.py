"""Fault injection for tests, as a plugin: a :class:`rlcore.interfaces.TrainerHandle` that makes one
trainer rank crash or hang as a chosen call starts.

A test registers this module as a plugin of the run it starts (``env=fault_env(spec)``: this
module named in ``RLCORE_PLUGINS``, the spec in ``RLCORE_FAULT``); its ``rlcore_wrap_trainer`` hook
wraps the run's trainer. No production code reads ``RLCORE_FAULT``. The spec
``<crash|hang>:<call>:<step>[:<rank>]`` picks the call (``logprobs``, ``train``, ``save_checkpoint``,
``load_checkpoint``, ``offload``, ``onload``, ``export_weights`` for both ``export_chunks`` and a ``run_on_ranks`` call
whose ``what`` starts with ``'export_weights'``), the run loop's step and the rank (default:
the last). The fault runs inside that rank's process (through ``run_on_ranks``), so the
trainer handle's own error reporting (a dead Ray actor named with the call and step, a hang
reported at ``cluster.timeout_s``) is what the tests see; with an in-process trainer the
driver itself exits.
"""

from __future__ import annotations

import os
import time
from typing import Any

import attrs

from rlcore.plugins import hookimpl

ENV = "RLCORE_FAULT"
CRASH_EXIT_CODE = 17


@attrs.frozen
class FaultSpec:
    kind: str  # "crash" or "hang"
    call: str
    step: int
    rank: int | None = None  # None: the last rank

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        parts = text.split(":")
        if len(parts) not in (3, 4) or parts[0] not in ("crash", "hang"):
            raise ValueError(f"{ENV}={text!r}: expected <crash|hang>:<call>:<step>[:<rank>]")
        return cls(parts[0], parts[1], int(parts[2]), int(parts[3]) if len(parts) == 4 else None)


def strike(backend: Any, rank: int, world_size: int, kind: str, at_rank: int | None) -> None:
    """Run on every trainer rank: the chosen one exits or sleeps."""
    if rank != (world_size - 1 if at_rank is None else at_rank):
        return
    # a test that acts on a rank mid-call (e.g. kills its node) waits for this line
    print(f"{ENV}: trainer rank {rank} {'exits' if kind == 'crash' else 'hangs'} now", flush=True)
    if kind == "crash":
        os._exit(CRASH_EXIT_CODE)
    time.sleep(10**6)


class FaultInjectingTrainer:
    """Wraps a trainer handle; the call named by ``spec`` at ``spec.step`` hits its rank first."""

    def __init__(self, inner, spec: FaultSpec):
        self.inner, self.spec = inner, spec

    @property
    def loop_step(self) -> int:
        return self.inner.loop_step

    @loop_step.setter
    def loop_step(self, step: int) -> None:
        self.inner.loop_step = step

    @property
    def in_process(self) -> bool:
        return self.inner.in_process

    def _maybe_strike(self, call: str, what: str) -> None:
        if call == self.spec.call and self.inner.loop_step == self.spec.step:
            self.inner.run_on_ranks(f"{__name__}:strike", self.spec.kind, self.spec.rank, what=what)

    def logprobs(self, batch, *, reference: bool = False, what: str = ""):
        self._maybe_strike("logprobs", what or "'logprobs'")
        return self.inner.logprobs(batch, reference=reference, what=what)

    def train(self, batch, algorithm) -> dict[str, float]:
        self._maybe_strike("train", "'train'")
        return self.inner.train(batch, algorithm)

    def save_checkpoint(self, path: str) -> None:
        self._maybe_strike("save_checkpoint", "'save_checkpoint'")
        self.inner.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self._maybe_strike("load_checkpoint", "'load_checkpoint'")
        self.inner.load_checkpoint(path)

    def offload(self, *, keep_weights: bool = False) -> None:
        self._maybe_strike("offload", "'offload'")
        self.inner.offload(keep_weights=keep_weights)

    def onload(self) -> None:
        self._maybe_strike("onload", "'onload'")
        self.inner.onload()

    def export_chunks(self, dtype=None, chunk_bytes: int = 1 << 30):
        self._maybe_strike("export_weights", "'export_weights' (refit)")
        yield from self.inner.export_chunks(dtype=dtype, chunk_bytes=chunk_bytes)

    def run_on_ranks(self, fn: str, *args, what: str = "") -> list:
        call = what.split("'")[1] if what.startswith("'") and what.count("'") >= 2 else fn
        self._maybe_strike(call, what or f"'{fn}'")
        return self.inner.run_on_ranks(fn, *args, what=what)

    def shutdown(self) -> None:
        self.inner.shutdown()


def fault_env(spec: str) -> dict[str, str]:
    """The environment variables that make a run started with them inject the fault ``spec``."""
    FaultSpec.parse(spec)  # a wrong spec fails in the test, not in the run it starts
    return {"RLCORE_PLUGINS": __name__, ENV: spec}


@hookimpl
def rlcore_wrap_trainer(trainer):
    """The run's trainer, wrapped to inject the fault ``RLCORE_FAULT`` names (None: no fault set)."""
    text = os.environ.get(ENV)
    return FaultInjectingTrainer(trainer, FaultSpec.parse(text)) if text else None
