"""Run checkpoints: written to ``step_N.tmp``, renamed to ``step_N`` when complete, last K kept.

A checkpoint holds the backend's own state (model, optimizer, scheduler, RNG: written by the
backend with torch.distributed.checkpoint or Megatron's dist_checkpointing) and the loop's
state (step, data position, RNG of the driver, counters) in ``loop_state.pt``, written last, so
a directory without it was never finished and is ignored on resume.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d+)$")
LOOP_STATE = "loop_state.pt"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last_k: int):
        self.root = Path(root)
        self.keep_last_k = keep_last_k

    def complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / LOOP_STATE).is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def save(self, step: int, save_backend, loop_state: dict[str, Any]) -> Path:
        """``save_backend(path)`` writes the backend's part; the loop state goes in last."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_backend(str(tmp / "backend"))
        torch.save(loop_state, tmp / LOOP_STATE)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in self.complete()[: -self.keep_last_k]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def load_loop_state(path: Path) -> dict[str, Any]:
        return torch.load(path / LOOP_STATE, weights_only=False)
