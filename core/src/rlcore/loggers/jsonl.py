"""Metrics as JSON Lines: one record per step, appended and flushed so a crash loses nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path


class JsonlLogger:
    def __init__(self, config, run_dir: Path):
        self.path = Path(run_dir) / config.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step}
        for key, value in metrics.items():
            value = float(value)
            record[key] = value if math.isfinite(value) else str(value)
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
