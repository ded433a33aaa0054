"""Loading checkpoint files without running code that may be inside them.

A checkpoint directory is input like any other: copied from elsewhere, or tampered with, its
pickles could name any callable. Everything a resume reads goes through here:

- ``.pt`` files: ``torch.load(weights_only=True)`` (tensors, containers and numbers only; numpy
  RNG state where a caller allows it);
- torch.distributed.checkpoint (DCP) directories: the ``.metadata`` pickle is read by an
  unpickler that knows only DCP's own metadata classes, and the non-tensor items DCP stores as
  pickled bytes are loaded with ``weights_only=True`` (:class:`SafeFileSystemReader`,
  :class:`SafeLoadPlanner`). For loaders that read a DCP directory themselves (Megatron's
  ``dist_checkpointing``), :func:`verify_dcp_dir` checks the same files first.

A refused file raises :class:`UnsafeCheckpointError`; a file that cannot be read (truncated,
garbled) raises :class:`DamagedCheckpointError`. Both name the file.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from rlcore.errors import CheckpointError, DamagedCheckpointError, UnsafeCheckpointError

__all__ = ["CheckpointError", "DamagedCheckpointError", "UnsafeCheckpointError", "SafeFileSystemReader",
           "SafeLoadPlanner", "load_tensors", "rank_failure", "read_dcp_metadata", "verify_dcp_dir"]


def numpy_rng_globals() -> list:
    """What ``np.random.get_state()`` pickles into, for files that store it as arrays."""
    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_tensors(path: str | Path, allow_numpy: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with errors that name the file."""
    path = Path(path)
    allowed = torch.serialization.safe_globals(numpy_rng_globals()) if allow_numpy else nullcontext()
    try:
        with allowed:
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{path}: refused to load: it holds objects that only running code could build "
                                    f"({_refusal(exc)}); it was not written by rlcore, or was altered") from None
    except FileNotFoundError:
        raise
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise DamagedCheckpointError(f"{path}: unreadable (truncated or garbled): {_first_line(exc)}") from None


def _refusal(exc: BaseException) -> str:
    """The line of torch's weights-only error that names what was refused (its first line only
    explains the weights_only default)."""
    named = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line]
    return named[0] if named else "objects outside the weights-only allow-list"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _dcp_allowed() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    }
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    # DCP's plain records (dataclasses and enums: building one sets fields, runs nothing); the
    # planner's are there when a loader caches save plans in the metadata (Megatron does).
    for module in (dcp_metadata, dcp_planner):
        for name in dir(module):
            value = getattr(module, name)
            if isinstance(value, type) and value.__module__ == module.__name__ and (
                    dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                allowed[(module.__name__, name)] = value
    for name in dir(torch):
        if isinstance(getattr(torch, name), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, torch dtypes/sizes and paths (Python's documented
    "restricting globals" pattern); anything else a pickle names is refused."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata") from None


def read_dcp_metadata(directory: str | Path) -> dcp_metadata.Metadata:
    path = Path(directory) / ".metadata"
    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _dcp_allowed()
    try:
        with path.open("rb") as f:
            found = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as exc:
        if "is not allowed" in str(exc):
            raise UnsafeCheckpointError(f"{path}: refused to load: {exc}; it was not written by torch.distributed.checkpoint, or was altered") from None
        raise DamagedCheckpointError(f"{path}: unreadable (truncated or garbled): {_first_line(exc)}") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise DamagedCheckpointError(f"{path}: unreadable (truncated or garbled): {_first_line(exc)}") from None
    if not isinstance(found, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(found).__name__}, not torch.distributed.checkpoint metadata")
    return found


def rank_failure(exc: CheckpointException) -> BaseException:
    """The error one rank raised inside DCP (DCP gathers them into a CheckpointException, which
    is a BaseException and so escapes ``except Exception``); a CheckpointError first."""
    causes = [pair[0] for pair in exc.failures.values()]
    for cause in causes:
        if isinstance(cause, CheckpointError):
            return cause
    return causes[0] if causes else CheckpointError(str(exc))


def _check_slice(directory: Path, info, what: str) -> None:
    """Unpickle one stored item with the weights-only unpickler; raise naming its file."""
    path = directory / info.relative_path
    try:
        with path.open("rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
    except OSError as exc:
        raise DamagedCheckpointError(f"{path}: unreadable: {_first_line(exc)}") from None
    if len(blob) != info.length:
        raise DamagedCheckpointError(f"{path}: truncated: {what} needs bytes {info.offset}-{info.offset + info.length}, "
                                     f"the file ends at {info.offset + len(blob)}")
    try:
        torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{path}: refused to load {what}: {_refusal(exc)}") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise DamagedCheckpointError(f"{path}: unreadable {what}: {_first_line(exc)}") from None


def verify_dcp_dir(directory: str | Path, tensors: bool = False) -> dcp_metadata.Metadata:
    """Check a DCP directory before a loader that unpickles it without restrictions reads it:
    the metadata, and every non-tensor item (``tensors=True``: every item, reading all the data)."""
    directory = Path(directory)
    found = read_dcp_metadata(directory)
    by_fqn = found.state_dict_metadata
    for index, info in (found.storage_data or {}).items():
        is_bytes = isinstance(by_fqn.get(index.fqn), dcp_metadata.BytesStorageMetadata)
        if tensors or is_bytes:
            _check_slice(directory, info, f"item '{index.fqn}'")
    return found


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by :func:`read_dcp_metadata`; a failed data read
    is traced to the file it came from."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(f"{self.path}: per-rank metadata files are not supported by the safe reader")
        found = read_dcp_metadata(Path(str(self.path)))
        if getattr(found, "storage_meta", None) is None:
            found.storage_meta = dcp_metadata.StorageMeta()
        found.storage_meta.load_id = self.load_id
        return found

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception:
            verify_dcp_dir(Path(str(self.path)), tensors=True)  # raises naming the file when it can
            raise


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading the non-tensor items it stores as pickles with ``weights_only``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            where = getattr(info, "relative_path", "a data file")
            raise UnsafeCheckpointError(f"{where}: refused to load item '{read_item.dest_index.fqn}': {_refusal(exc)}") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper, as its planner uses

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
