"""Paths under a run directory that stay under it, and outputs replaced whole or not at all.

Every file and directory a run writes under ``logger.log_dir`` is named through :func:`inside`,
which refuses a path that a symbolic link on the way (``sub -> ../other_run``, ``model ->
/elsewhere``) leads out of the run directory: past that link the run's lock protects nothing, and
another run's (or the system's) files would be written. What ``rlcore export`` copies is checked
with :func:`unsafe_links` first, so that a link in a run directory (``notes.txt -> /etc/passwd``)
never exports what it points at. :func:`replace_dir` writes a directory output (the final model,
the critic, an export) beside its place and renames it there when complete, and :func:`write_file`
does the same for a small file (``run.json``, ``config.yaml``, ``summary.json``): a full disk
leaves what was there before, and is one error naming the file, its directory and the space free.
What either leaves when its process is killed mid-write (``.NAME.tmp.PID``, ``.NAME.old.PID``) is
settled by the next start (:func:`settle_leftovers`). No heavy imports here.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable
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


def _beside(final: Path, kind: str, pid: int | None = None) -> Path:
    """Where :func:`replace_dir` and :func:`write_file` put ``final``'s new copy (``tmp``) or its replaced one (``old``)."""
    return final.with_name(f".{final.name}.{kind}.{os.getpid() if pid is None else pid}")


_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)\.(?P<pid>\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def settle_leftovers(directory: str | Path, names: Iterable[str]) -> list[str]:
    """What :func:`replace_dir` or :func:`write_file` of ``directory/NAME`` (each of ``names``) left
    when its process was killed (kill -9, a lost machine): only their own names (``.NAME.tmp.PID``,
    ``.NAME.old.PID``), of a process that no longer runs; anything else is never touched. A swap cut
    between its two renames is completed (the new copy is renamed into place only once whole);
    otherwise the partial copy, and a replaced one, are removed. Returns (and prints) a line for each."""
    directory, wanted = Path(directory), set(names) - {"", ".", ".."}
    if not wanted or not directory.is_dir() or directory.is_symlink():
        return []
    pids: dict[str, set[int]] = {}
    for entry in directory.iterdir():
        found = _LEFTOVER.match(entry.name)
        if found and found["name"] in wanted and int(found["pid"]) != os.getpid() and not _alive(int(found["pid"])):
            pids.setdefault(found["name"], set()).add(int(found["pid"]))
    done = []
    for name, dead in sorted(pids.items()):
        final = directory / name
        for pid in sorted(dead):
            tmp, old = _beside(final, "tmp", pid), _beside(final, "old", pid)
            if os.path.lexists(old) and not os.path.lexists(final):  # killed between the two renames
                (tmp if os.path.lexists(tmp) else old).rename(final)
                done.append(f"{final}: put back from what process {pid} left (it was killed while replacing it)")
            for left in (tmp, old):
                if os.path.lexists(left):
                    remove_no_follow(left)
                    done.append(f"{left}: removed (left by process {pid}, which no longer runs)")
    for line in done:
        print(f"note: {line}", flush=True)
    return done


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 // 10 else f"{n / 2**10:.1f} KiB"


def _kept(final: Path, existed: bool) -> str:
    return "its partial copy was removed and " + (f"the earlier {final.name} is kept" if existed else
                                                  f"nothing was left at {final}")


def _no_space(final: Path, what: str, needed_bytes: int, fix: str, kept: str) -> OutputWriteError:
    """The one-line error of a full disk: ``what`` was not written to ``final``, what it needs, what is
    free there, and what was ``kept``."""
    try:
        free = f"{shutil.disk_usage(final.parent).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return OutputWriteError(f"no space left on device: {what} could not be written to {final} (it needs at least "
                            f"{_size(needed_bytes)}; {free} in {final.parent}); {kept}. Free some space, or {fix}")


def write_file(path: str | Path, data: str | bytes, what: str, fix: str = "set logger.log_dir on a larger disk") -> Path:
    """``path`` holds what it held before or ``data``, never a part: written to ``.NAME.tmp.PID`` beside it
    (never through a link there), flushed to disk, renamed over it. A full disk is an
    :class:`OutputWriteError` naming ``what``, the file, its directory and the space free (:func:`replace_dir`'s)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = _beside(path, "tmp")
    existed = os.path.lexists(path)
    remove_no_follow(tmp)  # a killed earlier attempt's, under this process id's name
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.lexists(tmp):
            remove_no_follow(tmp)
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)) and disk_full(exc, path.parent):
            raise _no_space(path, what, len(payload), fix, _kept(path, existed)) from exc
        raise
    return path


def append_whole(fd: int, data: bytes, path: Path, what: str, fix: str = "set logger.log_dir on a larger disk") -> None:
    """``data`` appended to ``path`` (open as ``fd``, ``O_APPEND``) whole or not at all: a write that fails
    or is cut short is cut back to the file's earlier end, so the file only ever holds whole records. A
    full disk is an :class:`OutputWriteError` naming ``what``, the file, its directory and the space free."""
    start = os.fstat(fd).st_size
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, "No space left on device (a short write)")
    except OSError as exc:
        os.ftruncate(fd, start)
        kept = "the part written was cut off: the file keeps every earlier record whole"
        if disk_full(exc, path.parent):
            raise _no_space(path, what, len(data), fix, kept) from exc
        raise OSError(exc.errno, f"{path}: {what} could not be written ({exc.strerror}); {kept}") from exc


def replace_dir(final: str | Path, write: Callable[[Path], None], what: str, needed_bytes: int = 0,
                fix: str = "set logger.log_dir on a larger disk") -> Path:
    """``write(tmp)`` fills a new directory beside ``final``; once it returns, the directory takes
    ``final``'s place (an earlier ``final`` is removed only then). If ``write`` fails, its partial
    directory is removed and ``final`` is left as it was; a full disk is an :class:`OutputWriteError`
    naming ``final``, the space it needed (at least ``needed_bytes``) and the space there was, and
    ``fix``: what else to do."""
    final = Path(final)
    tmp = _beside(final, "tmp")
    settle_leftovers(final.parent, [final.name])  # a killed earlier attempt's, by another process
    remove_no_follow(tmp)  # a killed earlier attempt's, under this process id's name
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
    except BaseException as exc:
        written = tree_bytes(tmp) if tmp.exists() else 0
        remove_no_follow(tmp)
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)) and disk_full(exc, final.parent):
            raise _no_space(final, what, max(needed_bytes, written), fix, _kept(final, final.exists())) from exc
        raise
    old = _beside(final, "old")
    if final.exists() or final.is_symlink():
        final.rename(old)  # a link is moved as a link: what it points at is never touched
    tmp.rename(final)
    remove_no_follow(old)
    return final
