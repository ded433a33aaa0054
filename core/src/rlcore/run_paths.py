"""Paths under a run directory that stay under it, and outputs replaced whole or not at all.

Every file and directory a run writes under ``logger.log_dir`` is named through :func:`inside`,
which refuses a path that a symbolic link on the way (``sub -> ../other_run``, ``model ->
/elsewhere``) leads out of the run directory: past that link the run's lock protects nothing, and
another run's (or the system's) files would be written. What ``rlcore export`` copies is checked
with :func:`unsafe_links` first, so that a link in a run directory (``notes.txt -> /etc/passwd``)
never exports what it points at. :func:`replace_dir` writes a directory output (the final model,
the critic, an export) beside its place and renames it there when complete: a full disk leaves
what was there before, and says how much space there was. No heavy imports here.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from rlcore.config.structure import ConfigError
from rlcore.errors import CheckpointError

# The run directory's own files, which no configurable output name may take.
CONTROL_FILES = ("run.json", "run.lock", "config.yaml", "summary.json", "curves.png")
OUTPUT_DIRS = ("model", "critic", "checkpoints", "tensorboard")


class OutputWriteError(CheckpointError):
    """An output directory could not be written (typically: the disk is full); what was there is kept."""


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_output_name(value: str, key: str) -> None:
    """A configurable output name (``logger.jsonl.filename``): a plain relative file path inside
    logger.log_dir that is none of the run's own files or directories, else a ConfigError naming ``key``."""
    parts = value.split("/")
    if not value or value.startswith("/") or "\\" in value or any(part in ("", ".", "..") for part in parts):
        raise ConfigError(key, f"{value!r} must be a file name inside logger.log_dir (relative, no '.', '..' or empty "
                          "parts); to write elsewhere set logger.log_dir")
    if value in CONTROL_FILES or parts[0] in OUTPUT_DIRS:
        raise ConfigError(key, f"{value!r} is the run's own {'file' if value in CONTROL_FILES else 'directory'} "
                          f"inside logger.log_dir; choose another name (the run writes {', '.join(CONTROL_FILES)} and "
                          f"{', '.join(d + '/' for d in OUTPUT_DIRS)})")


def inside(run_dir: str | Path, relative: str | Path, key: str = "logger.log_dir", *, file: bool = False) -> Path:
    """``run_dir/relative``, refused (a ConfigError naming ``key``) when it resolves outside
    ``run_dir`` through a symbolic link, or (``file``) when it is a directory. The path is resolved
    as it stands now: nothing is created."""
    run_dir = Path(run_dir)
    path = run_dir / relative
    real = path.resolve()
    if not _within(real, run_dir.resolve()):
        raise ConfigError(key, f"{path} leads out of the run directory {run_dir} (to {real}, through a symbolic link): "
                          "the run writes only inside its logger.log_dir; remove the link or choose another logger.log_dir")
    if file and real.is_dir():
        raise ConfigError(key, f"{path} is a directory, not a file the run can write; name a file inside logger.log_dir")
    return path


def unsafe_links(tree: str | Path, boundary: str | Path) -> list[tuple[Path, Path]]:
    """Every symbolic link at or under ``tree`` whose target resolves outside ``boundary`` (a
    dangling one by where it would point), or is a directory holding the link (a loop a copy would
    follow forever), with that target. Linked directories are not entered."""
    tree, limit = Path(tree), Path(boundary).resolve()
    candidates = [tree]
    if tree.is_dir() and not tree.is_symlink():
        for parent, dirs, files in os.walk(tree):  # followlinks=False: a linked directory is a link, not a tree
            candidates += [Path(parent) / name for name in (*dirs, *files)]
    found = []
    for link in (p for p in candidates if p.is_symlink()):
        target = link.resolve()
        if not _within(target, limit) or _within(link.parent.resolve(), target):
            found.append((link, target))
    return found


def refuse_unsafe_links(tree: str | Path, boundary: str | Path, what: str) -> None:
    """A CheckpointError naming the first links of ``tree`` that leave ``boundary`` or loop (:func:`unsafe_links`)."""
    found = unsafe_links(tree, boundary)
    if found:
        shown = "; ".join(f"{link} -> {target}" for link, target in found[:3]) + ("; ..." if len(found) > 3 else "")
        raise CheckpointError(f"{what}: {len(found)} symbolic link(s) point outside {Path(boundary)} or back into "
                              f"their own directory ({shown}); nothing was copied. Replace each link by the file it "
                              "should hold, or remove it")


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (links counted as links)."""
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                pass
    return total


def remove_no_follow(path: Path) -> None:
    """Remove ``path`` without following a link: a link is unlinked, a directory deleted below it."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


_UNEXPECTED_POS = re.compile(r"unexpected pos \d+ vs \d+")
_NEARLY_FULL_BYTES = 16 << 20


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every error it wraps: causes, contexts, each rank's error inside DCP's CheckpointException."""
    api = sys.modules.get("torch.distributed.checkpoint.api")  # not imported: no such exception exists
    seen: dict[int, BaseException] = {}
    pending = [exc]
    while pending:
        e = pending.pop()
        if id(e) in seen:
            continue
        seen[id(e)] = e
        pending += [x for x in (e.__cause__, e.__context__) if x is not None]
        if api is not None and isinstance(e, api.CheckpointException):
            pending += [pair[0] for pair in e.failures.values()]
    return list(seen.values())


def disk_full(exc: BaseException, root: Path | None = None) -> bool:
    """Whether ``exc`` (or an error it wraps) is the disk filling up. Ray's errors carry the rank's
    message as text. torch's own file writer (DCP writes through it) reports a short write only as
    "unexpected pos A vs B": that counts when ``root``'s file system is then (nearly) full."""
    chain = _chain(exc)
    if root is not None and any(_UNEXPECTED_POS.search(str(e)) for e in chain):
        try:
            if shutil.disk_usage(root).free < _NEARLY_FULL_BYTES:
                return True
        except OSError:
            pass
    return any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
               or "No space left on device" in str(e) or "Errno 28" in str(e) for e in chain)


def replace_dir(final: str | Path, write: Callable[[Path], None], what: str, needed_bytes: int = 0,
                fix: str = "set logger.log_dir on a larger disk") -> Path:
    """``write(tmp)`` fills a new directory beside ``final``; once it returns, the directory takes
    ``final``'s place (an earlier ``final`` is removed only then). If ``write`` fails, its partial
    directory is removed and ``final`` is left as it was; a full disk is an :class:`OutputWriteError`
    naming ``final``, the space it needed (at least ``needed_bytes``) and the space there was, and
    ``fix``: what else to do."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp.{os.getpid()}")
    remove_no_follow(tmp)  # a killed earlier attempt's, under this process id's name
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
    except BaseException as exc:
        written = tree_bytes(tmp) if tmp.exists() else 0
        remove_no_follow(tmp)
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)) and disk_full(exc, final.parent):
            free = shutil.disk_usage(final.parent).free
            kept = f"the earlier {final} is kept" if final.exists() else f"nothing was left at {final}"
            raise OutputWriteError(
                f"no space left on device: {what} could not be written to {final} (it needs at least "
                f"{max(needed_bytes, written) / 2**20:.1f} MiB; {free / 2**20:.1f} MiB free); its partial copy was "
                f"removed and {kept}. Free some space, or {fix}") from exc
        raise
    old = final.with_name(f".{final.name}.old.{os.getpid()}")
    if final.exists() or final.is_symlink():
        final.rename(old)  # a link is moved as a link: what it points at is never touched
    tmp.rename(final)
    remove_no_follow(old)
    return final
