"""Metrics as JSON Lines: one record per step, each tagged with the run id.

Each record is appended with one ``write`` to an ``O_APPEND`` descriptor; a write that fails or
is cut short (disk full) is undone by truncating the file back, so the file only ever holds whole
records. On resume, records of the steps after the checkpoint are removed (they are redone), and
records the checkpoint holds that the file lacks (a kill between the checkpoint and the write)
are put back: each step has exactly one record.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rlcore.config.run_paths import append_whole, inside, write_file


def _run_id(run_dir: Path) -> str:
    try:
        return str(json.loads((run_dir / "run.json").read_text()).get("run_id", ""))
    except (OSError, ValueError):
        return ""


class JsonlLogger:
    def __init__(self, config, run_dir: Path):
        self.path = inside(run_dir, config.filename, "logger.jsonl.filename", file=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = _run_id(Path(run_dir))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._append(self._line(metrics, step).encode(), step)

    def _line(self, metrics: dict[str, float], step: int) -> str:
        record: dict = {"step": step, "run_id": self.run_id}
        for key, value in metrics.items():
            value = float(value)
            record[key] = value if math.isfinite(value) else str(value)
        return json.dumps(record, sort_keys=True) + "\n"

    def _append(self, data: bytes, step: int) -> None:
        append_whole(self._fd, data, self.path, f"the metrics record of step {step}")

    def resume_at(self, step: int, records: list[dict] | None = None) -> None:
        """Keep the records of steps up to ``step`` (the checkpoint resumed from), and add those of
        ``records`` (the checkpoint's, each with its ``step``) the file lacks."""
        kept: list[tuple[int, str]] = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                at = json.loads(line)["step"]
                if at <= step:
                    kept.append((at, line + "\n"))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut off by an older version's crash
        present = {at for at, _ in kept}
        for record in records or ():
            at = record.get("step")
            if isinstance(at, int) and at <= step and at not in present:
                kept.append((at, self._line({k: v for k, v in record.items() if k != "step"}, at)))
                present.add(at)
        kept.sort(key=lambda pair: pair[0])  # stable: lines of one step keep their order
        write_file(self.path, "".join(line for _, line in kept), "the metrics kept on resume")
        os.close(self._fd)  # the file it was open on is replaced
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
