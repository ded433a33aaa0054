"""``rlcore run`` in fresh processes forked from a server that has imported the libraries once.

A test that starts many short runs one after another pays the imports (torch, transformers, the
plugins: seconds on two cores) in each. Here a ``multiprocessing`` fork server imports them once,
before anything runs; each run is a child forked from it: its own process (its own pid, signals,
stdout, stderr and exit status) with nothing of another run in it, which runs the CLI's ``main`` on
its command line, as ``python -m rlcore.cli`` does, or a script, as ``python -c`` does.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
from pathlib import Path

# What a CPU run of the tiny recipes (fsdp2 backend, hf generator, math environment) imports; a module
# missing here is imported by the run itself, as in a fresh interpreter.
PRELOAD = ["torch", "torch._inductor.config", "transformers", "transformers.models.llama.modeling_llama", "rlcore.cli.commands",
           "rlcore.controller.run", "rlcore.controller.grpo_run", "rlcore_fsdp2.backend", "rlcore_math.envs", "math_verify"]


def _redirect(env: dict[str, str], stdout: str, stderr: str, cwd: str | None = None) -> None:
    """In the forked child: the caller's environment and working directory (``cwd``, when given), and
    stdout and stderr to these files. What is read at interpreter start or at import (PYTHONWARNINGS,
    OMP_NUM_THREADS for torch) is the server's, which has this process's environment: a caller passes
    only variables read while the run runs."""
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the process's own fd 1 and 2, as a CLI's
    sys.stderr = sys.__stderr__ = open(2, "w", closefd=False)  # noqa: SIM115


def _cli_main(argv: list[str], env: dict[str, str], stdout: str, stderr: str, cwd: str | None = None) -> None:
    _redirect(env, stdout, stderr, cwd)
    sys.argv = ["rlcore", *argv]
    from rlcore.cli.commands import main

    sys.exit(main())


def _script(code: str, env: dict[str, str], stdout: str, stderr: str, cwd: str | None = None) -> None:
    _redirect(env, stdout, stderr, cwd)
    sys.argv = ["-c"]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the test's own script


class PreloadedCli:
    """``start(argv, env, stdout, stderr)`` -> a started ``multiprocessing.Process`` (``pid``, ``join``,
    ``exitcode``); ``run_script(code, env, tmp, timeout)`` -> what ``subprocess.run([python, "-c",
    code], capture_output=True, text=True)`` returns, ``run_cli(argv, ...)`` the same for ``rlcore``;
    ``close()`` stops the fork server.

    The stdlib has one fork server per process. One that is running already (another test's, such
    as the math environment's grading pool's) is stopped first, as it preloads other modules, and
    ``close()`` leaves the next user a stopped server with the preload list it had. Stopping it takes
    the stdlib's private handle; on a Python without it, every run is a fresh interpreter (slower,
    the same processes otherwise)."""

    def __init__(self):
        self.server = getattr(multiprocessing.forkserver, "_forkserver", None)  # noqa: SLF001 - no public handle on it
        self.forked = callable(getattr(self.server, "_stop", None))
        if not self.forked:
            return
        self.saved_preload = list(getattr(self.server, "_preload_modules", ["__main__"]))
        self.server._stop()  # noqa: SLF001
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)

    def start(self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path | None = None):
        if not self.forked:
            return _Interpreter([sys.executable, "-m", "rlcore.cli", *argv], env, stdout, stderr or stdout)
        args = (list(argv), dict(env), str(stdout), str(stderr or stdout))
        process = self.context.Process(target=_cli_main, args=args, daemon=False)
        process.start()
        return process

    def run_script(self, code: str, env: dict[str, str], tmp: Path, timeout: float) -> subprocess.CompletedProcess:
        return self._run(_script, code, env, tmp, timeout, ["-c", code])

    def run_cli(self, argv: list[str], env: dict[str, str], tmp: Path, timeout: float,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
        """What ``subprocess.run(["rlcore", *argv], capture_output=True, text=True, cwd=cwd)`` returns."""
        return self._run(_cli_main, list(argv), env, tmp, timeout, ["rlcore", *argv], cwd)

    def _run(self, target, what, env: dict[str, str], tmp: Path, timeout: float, args: list[str],
             cwd: Path | None = None) -> subprocess.CompletedProcess:
        if not self.forked:
            argv = [sys.executable, "-c", what] if target is _script else [sys.executable, "-m", "rlcore.cli", *what]
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        out, err = (tmp / f"process-{os.urandom(3).hex()}.{name}" for name in ("out", "err"))
        out.touch()
        err.touch()
        cwd = None if cwd is None else str(cwd)
        process = self.context.Process(target=target, args=(what, dict(env), str(out), str(err), cwd), daemon=False)
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(args, timeout)
        return subprocess.CompletedProcess(args, process.exitcode, out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        if not self.forked:
            return
        self.server._stop()  # noqa: SLF001
        self.context.set_forkserver_preload(self.saved_preload)


class _Interpreter:
    """A fresh interpreter with what ``start`` callers use of a ``multiprocessing.Process``."""

    def __init__(self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path):
        with open(stdout, "ab") as out, open(stderr, "ab") as err:
            self.popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if stderr == stdout else err)
        self.pid = self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()
