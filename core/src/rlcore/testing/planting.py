"""Plant a code-running pickle in a checkpoint file, to check that loading it runs nothing.

The planted object's ``__reduce__`` makes any unrestricted unpickler run ``touch <marker>``:
a loader that runs code from the checkpoint leaves the marker file behind. How it is planted
depends on the file: a whole ``torch.save`` file (``.pt``), a plain pickle (DCP's ``.metadata``
and anything else), or, in a DCP data file (``.distcp``), at the start of every item stored in
it (DCP unpickles each item's bytes on its own), keeping the file's length.
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
from pathlib import Path


class RunsCode:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: str | Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def plant(path: Path, marker: Path, checkpoint_root: Path | None = None) -> None:
    """Replace ``path``'s content (or, in a ``.distcp`` file, each stored item) with :class:`RunsCode`."""
    payload = pickle.dumps(RunsCode(marker), protocol=2)
    if path.suffix == ".pt":
        import torch

        buffer = io.BytesIO()
        torch.save(RunsCode(marker), buffer)
        path.write_bytes(buffer.getvalue())
    elif path.suffix == ".distcp":
        _plant_in_items(path, payload)
    else:
        path.write_bytes(payload)


def _plant_in_items(path: Path, payload: bytes) -> None:
    from rlcore.training.safe_load import read_dcp_metadata

    data = bytearray(path.read_bytes())
    metadata = read_dcp_metadata(path.parent)
    offsets = [info.offset for info in metadata.storage_data.values() if info.relative_path == path.name]
    for offset in offsets or [0]:
        end = min(len(data), offset + len(payload))
        data[offset:end] = payload[: end - offset]
    path.write_bytes(bytes(data))


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file())
