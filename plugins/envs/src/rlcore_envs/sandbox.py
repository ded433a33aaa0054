"""Run untrusted Python under bubblewrap, with limits, and tell the solution's failures from the sandbox's.

Hand-written on purpose: no library of the field wraps bubblewrap with per-run resource limits (the
ecosystem's code environments use containers or hosted sandboxes, which CPU CI machines do not have).

What a run sees (:func:`bwrap_command`): a fresh user, PID, network, IPC, UTS and cgroup namespace
(no network at all: only a loopback device that is down), uid 65534 with no capabilities, no new
user namespaces; an empty root, read-only, holding only the interpreter's installation (its
``site-packages`` hidden under an empty tmpfs), the shared libraries it links (found with ``ldd``),
a minimal ``/dev`` and one writable tmpfs, ``/tmp``, of ``tmp_size_mb``. No ``/etc``, no ``/proc``,
no home, no project, no shell.

Limits: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` and ``RLIMIT_NPROC`` are
set by the runner inside the sandbox before the solution runs (inside the new user namespace,
so the process limit counts this sandbox only); the wall-clock limit is the host's (the whole
process group is killed). The kernel never applies ``RLIMIT_NPROC`` to uid 0, which the sandbox's
uid maps to when rlcore runs as root: then a pids cgroup per run holds the limit (cgroup v1 or v2),
and without a writable one the sandbox refuses to start rather than run without a process limit.

A run that ends before the runner's ready mark is an infrastructure failure (bwrap missing,
namespaces refused, the machine out of processes): :class:`SandboxResult` says so with
``infra=True`` and the pool retries it; it is never the solution's fault.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import attrs

from rlcore_envs.config import SandboxConfig
from rlcore_envs.sandbox_runner import READY, RESULT

RUNNER_SOURCE = Path(__file__).with_name("sandbox_runner.py").read_text()
SANDBOX_UID = 65534
_SIGNALS = {signal.SIGKILL: "killed", signal.SIGXCPU: "cpu_time_limit", signal.SIGSEGV: "crashed",
            signal.SIGBUS: "crashed", signal.SIGABRT: "crashed", signal.SIGILL: "crashed", signal.SIGFPE: "crashed",
            signal.SIGXFSZ: "file_size_limit"}


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start here (bwrap missing, namespaces refused, no process limit possible)."""


@attrs.define
class SandboxResult:
    """One run: each input's outcome, or why there is none. ``reason`` is ``ok`` when the runner
    finished; else ``error`` (the solution did not load), ``wall_time_limit``, ``cpu_time_limit``,
    ``crashed``, ``killed``, ``file_size_limit``, ``exited`` or ``infra``."""

    reason: str
    tests: list[dict] = attrs.field(factory=list)  # {"value": ...} or {"error": "..."} per input
    error: str | None = None
    infra: bool = False
    seconds: float = 0.0
    detail: str = ""
    attempts: int = 0  # sandbox starts that failed before this one (retries)


def python_install(config: SandboxConfig) -> tuple[Path, Path]:
    """(interpreter, its installation prefix)."""
    if config.python:
        exe = Path(config.python).resolve()
        return exe, exe.parent.parent
    prefix = Path(sys.base_prefix).resolve()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return prefix / "bin" / version, prefix


@functools.lru_cache(maxsize=4)
def linked_libraries(exe: str, prefix: str) -> tuple[str, ...]:
    """Every shared library the interpreter and its extension modules link, as ``ldd`` resolves them
    (paths as the loader asks for them and their real files)."""
    dynload = sorted(str(p) for p in Path(prefix).glob("lib/python3*/lib-dynload/*.so"))
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable("ldd not found: it lists the libraries the sandboxed interpreter needs (Debian: libc-bin)")
    out = subprocess.run([ldd, exe, *dynload], capture_output=True, text=True, timeout=60).stdout
    paths = set()
    for line in out.splitlines():
        for token in line.split():
            if token.startswith("/") and not token.endswith(":") and os.path.exists(token):
                paths.add(token)
                paths.add(os.path.realpath(token))
    return tuple(sorted(p for p in paths if not p.startswith(prefix + "/")))


def bwrap_command(config: SandboxConfig) -> list[str]:
    exe, prefix = python_install(config)
    cmd = [config.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid",
           str(SANDBOX_UID), "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
           "--ro-bind", str(prefix), str(prefix)]
    for site in sorted(prefix.glob("lib/python3*/site-packages")):
        cmd += ["--tmpfs", str(site), "--remount-ro", str(site)]
    for lib in linked_libraries(str(exe), str(prefix)):
        cmd += ["--ro-bind", lib, lib]
    cmd += ["--dev", "/dev", "--size", str(config.tmp_size_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp",
            "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0",
            "--remount-ro", "/dev", "--remount-ro", "/", str(exe), "-I", "-S", "-B", "-c", RUNNER_SOURCE]
    return cmd


class PidsCgroup:
    """A pids cgroup for one run (only used as root, where RLIMIT_NPROC does not apply)."""

    ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))

    def __init__(self, limit: int):
        self.path = None
        for root in self.ROOTS:
            if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
                path = root / f"rlcore-sandbox-{uuid.uuid4().hex[:12]}"
                try:
                    path.mkdir()
                    (path / "pids.max").write_text(str(limit))
                except OSError:
                    _rmdir(path)
                    continue
                self.path = path
                return
        raise SandboxUnavailable("rlcore runs as root, where the kernel ignores RLIMIT_NPROC, and no writable pids cgroup "
                                 f"was found under {[str(r) for r in self.ROOTS]}: the sandbox cannot limit processes. "
                                 "Run as a non-root user or give the process a writable pids cgroup")

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started by a shell that first moves itself into the cgroup, then execs ``cmd`` (same pid):
        bwrap and all it starts stay inside. Not a ``preexec_fn``: Python code between fork and exec in a
        process with other threads (a training run's) can crash or deadlock the child."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *cmd]

    def close(self) -> None:
        _rmdir(self.path)


def _rmdir(path) -> None:
    for _ in range(50):  # the cgroup is removable once its killed processes are reaped
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def run_in_sandbox(config: SandboxConfig, solution: str, entry_point: str, inputs: list, per_test_timeout_s: float) -> SandboxResult:
    """Run ``entry_point(*args)`` of ``solution`` for every ``args`` of ``inputs`` in a fresh sandbox."""
    started = time.perf_counter()
    limits = {"cpu_time_s": config.cpu_time_s, "memory_bytes": config.memory_mb << 20,
              "file_size_bytes": config.file_size_mb << 20, "max_open_files": config.max_open_files,
              "max_processes": config.max_processes + 1, "per_test_timeout_s": per_test_timeout_s}  # +1: bwrap's init
    job = json.dumps({"solution": solution, "entry_point": entry_point, "inputs": inputs, "limits": limits})
    try:
        cgroup = PidsCgroup(config.max_processes + 3) if os.geteuid() == 0 else None  # + bwrap's two and the runner's fork
        cmd = bwrap_command(config)
    except SandboxUnavailable as exc:
        return SandboxResult("infra", infra=True, detail=str(exc))
    try:
        proc = subprocess.Popen(cgroup.wrap(cmd) if cgroup else cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        if cgroup:
            cgroup.close()
        return SandboxResult("infra", infra=True, detail=f"cannot start {config.bwrap!r}: {exc}")
    try:
        out, err, timed_out = communicate_bounded(proc, job.encode(), config.wall_time_s, config.max_output_bytes)
    finally:
        if cgroup:
            cgroup.close()
    result = _read(out, err, proc.returncode, timed_out)
    result.seconds = time.perf_counter() - started
    return result


STDERR_TAIL_BYTES = 4000  # of the sandbox's stderr, the end: where a traceback's last lines are


def communicate_bounded(proc: subprocess.Popen, job: bytes, wall_time_s: float, max_output_bytes: int) -> tuple[bytes, bytes, bool]:
    """``job`` to the process's stdin; the first ``max_output_bytes`` of its stdout and the last
    :data:`STDERR_TAIL_BYTES` of its stderr, read to their end as they come (a solution writing
    gigabytes to its file descriptors costs no more memory than that); and whether it ran past
    ``wall_time_s`` (then its process group is killed)."""
    readers = [_BoundedReader(proc.stdout, max_output_bytes, keep_head=True),
               _BoundedReader(proc.stderr, STDERR_TAIL_BYTES, keep_head=False)]
    writer = threading.Thread(target=_write_and_close, args=(proc.stdin, job), daemon=True)
    writer.start()
    try:
        proc.wait(timeout=wall_time_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap and, through --die-with-parent, the whole sandbox
        except ProcessLookupError:
            pass
        proc.wait()
        timed_out = True
    for reader in readers:  # the pipes close as the sandbox ends (--die-with-parent); bounded all the same
        reader.thread.join(timeout=wall_time_s)
    return bytes(readers[0].data), bytes(readers[1].data), timed_out


def _write_and_close(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):  # the process ended without reading it all: its result says why
        pass


class _BoundedReader:
    """Reads a pipe to its end on a thread of its own, keeping at most ``limit`` bytes of it: the first
    (``keep_head``) or the last."""

    def __init__(self, pipe, limit: int, keep_head: bool):
        self.pipe, self.limit, self.keep_head = pipe, limit, keep_head
        self.data = bytearray()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with self.pipe:
            while chunk := os.read(self.pipe.fileno(), 1 << 16):
                if self.keep_head:
                    self.data += chunk[: max(0, self.limit - len(self.data))]
                else:
                    self.data += chunk
                    del self.data[: max(0, len(self.data) - self.limit)]


def _read(out: bytes, err: bytes, returncode: int, timed_out: bool) -> SandboxResult:
    text = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace").strip()
    if READY not in text:
        why = "did not start within the wall-time limit" if timed_out else f"exited {returncode} before the runner started"
        return SandboxResult("infra", infra=True, detail=f"sandbox {why}: {stderr[-500:]}")
    lines = [line for line in text.splitlines() if line.startswith(RESULT)]
    if lines and not timed_out:
        try:
            payload = json.loads(lines[-1][len(RESULT):])
            return SandboxResult("error" if payload.get("error") else "ok", tests=list(payload.get("tests", [])),
                                 error=payload.get("error"))
        except (ValueError, AttributeError):
            return SandboxResult("exited", detail="unreadable result line")
    if timed_out:
        return SandboxResult("wall_time_limit", detail="killed at the wall-time limit")
    # bwrap passes the child's status on: 128 + signal for a signal death
    sig = returncode - 128 if returncode > 128 else -returncode if returncode < 0 else 0
    if sig:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return SandboxResult(_SIGNALS.get(sig, "killed"), detail=f"ended by {name}: {stderr[-300:]}")
    return SandboxResult("exited", detail=f"exited {returncode} without a result: {stderr[-300:]}")
