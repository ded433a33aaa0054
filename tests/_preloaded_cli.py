"""``rlcore run`` in fresh processes forked from a server that has imported the libraries once.

A test that starts many short ``rlcore run`` processes one after another (kills and resumes) pays
the imports (torch, transformers, the plugins: seconds on two cores) in each. Here a
``multiprocessing`` fork server imports them once, before anything runs; each run is a child forked
from it: its own process (its own pid, signals and exit status), with nothing of another run in it,
that runs the CLI's ``main`` on its command line as ``python -m rlcore.cli`` does.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from pathlib import Path

# What a CPU run of the tiny recipes (fsdp2 backend, hf generator, math environment) imports; a module
# missing here is imported by the run itself, as in a fresh interpreter.
PRELOAD = ["torch", "torch._inductor.config", "transformers", "transformers.models.llama.modeling_llama", "rlcore.cli",
           "rlcore.controller.run", "rlcore.controller.grpo_run", "rlcore_fsdp2.backend", "rlcore_math.envs", "math_verify"]


def _main(argv: list[str], env: dict[str, str], output: str) -> None:
    """In the forked child: the run's environment, stdout and stderr to ``output``, then the CLI."""
    os.environ.update(env)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the process's own fd 1 and 2, as a CLI's
    sys.stderr = sys.__stderr__ = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = ["rlcore", *argv]
    from rlcore.cli import main

    sys.exit(main())


class PreloadedCli:
    """``start(argv, env, output)`` -> a started ``multiprocessing.Process`` (``pid``, ``join``,
    ``exitcode``); ``close()`` stops the fork server.

    The stdlib has one fork server per process. One that is running already (another test's, such
    as the math environment's grading pool's) is stopped first, as it preloads other modules, and
    ``close()`` leaves the next user a stopped server with the preload list it had."""

    def __init__(self):
        self.server = multiprocessing.forkserver._forkserver  # noqa: SLF001 - no public handle on it
        self.saved_preload = list(getattr(self.server, "_preload_modules", ["__main__"]))
        self.server._stop()  # noqa: SLF001
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)

    def start(self, argv: list[str], env: dict[str, str], output: Path) -> multiprocessing.Process:
        process = self.context.Process(target=_main, args=(list(argv), dict(env), str(output)), daemon=False)
        process.start()
        return process

    def close(self) -> None:
        self.server._stop()  # noqa: SLF001
        self.context.set_forkserver_preload(self.saved_preload)
