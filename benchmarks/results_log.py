"""One JSON object per benchmark row, appended to ``benchmarks/results.jsonl``, the raw record behind ``docs/performance.md``.

Each row carries ``date``, ``machine``, ``commit``, ``bench``, ``config``, ``variant``, ``gpus``,
its figures under stable names (``tokens_per_s``, ``mfu``, ``step_s``, ...) and a ``run_id``
shared by the rows of one call, so a ratio is always read from rows measured side by side.
``RLCORE_RUN_ID`` hands a parent's run id to the processes it starts; ``RLCORE_RESULTS`` redirects the file (on the GPU machines: ``$OUT/results.jsonl``, appended to
the repository's file afterwards); ``RLCORE_COMMIT`` names the commit where no ``.git`` travels.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import uuid
from pathlib import Path

from rlcore.controller.allocator import ALLOCATOR_ENV, DEFAULT_ALLOCATOR_CONF  # what rlcore.run sets where nothing did

RUN_ID = os.environ.get("RLCORE_RUN_ID") or f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
DEFAULT_PATH = Path(__file__).resolve().parent / "results.jsonl"


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001 - a label, never a failure
        pass
    return f"cpu ({os.cpu_count()} cores)"


def commit() -> str:
    if os.environ.get("RLCORE_COMMIT"):
        return os.environ["RLCORE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def append(rows: list[dict], *, bench: str, config: str, gpus: int) -> Path:
    """Append ``rows`` (each with at least ``variant``) and return the file written."""
    path = Path(os.environ.get("RLCORE_RESULTS") or DEFAULT_PATH)
    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
             "commit": commit(), "bench": bench, "config": config, "gpus": gpus, "run_id": RUN_ID}
    allocator_conf = os.environ.get(ALLOCATOR_ENV)
    with path.open("a") as f:
        for row in rows:
            if allocator_conf is not None:  # the settings torch's allocator ran with ("": torch's own defaults)
                row = {**row, "allocator_conf": allocator_conf}
                if allocator_conf != DEFAULT_ALLOCATOR_CONF:  # they change its memory: the variant names them
                    row["variant"] = f"{row['variant']} [{ALLOCATOR_ENV}={allocator_conf}]"
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            f.write(json.dumps({**stamp, **clean}, default=str) + "\n")
    return path


def argv_without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without ``--option X``, ``--option=X`` and the flag ``--option`` for each of ``options``
    (a following word that starts with ``--`` is not taken as its value)."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in options:
            skip = "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        kept.append(arg)
    return kept


def run_each(script: str, argv: list[str], drop: tuple[str, ...], runs: list[list[str]]) -> int:
    """Run ``script`` once per entry of ``runs`` (its extra arguments), each in a fresh process with
    ``argv`` minus ``drop``; all under this call's run id. Returns how many failed."""
    import sys

    base, env, failed = argv_without(argv, drop), {**os.environ, "RLCORE_RUN_ID": RUN_ID}, 0
    for extra in runs:
        failed += subprocess.run([sys.executable, script, *base, *extra], env=env).returncode != 0
    return failed
