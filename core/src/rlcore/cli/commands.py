"""The ``rlcore`` command: run, plugins, config, recipes, doctor.

Rich tables for people, ``--json`` for machines. Errors in recipes, plugins and data (a dataset's
:class:`~rlcore.errors.DataError`, naming the file and row) exit with code 2 and one clear message,
not a traceback. ``kill -USR1 <pid>`` makes a running command print every thread's stack to stderr
and go on (:func:`install_stack_dump`): how to see where a run that seems hung is waiting. A run
whose process does not exit after its summary is written (a thread or an atexit handler that never
returns) is ended after ``cluster.exit_timeout_s`` with its own status, also when the run failed
(:func:`start_exit_watchdog`; only when ``main`` reads the command line itself, not for in-process
callers that pass ``argv``).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import shlex
import shutil
import signal
import sys
import threading
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rlcore.cli.parser import Parser
from rlcore.config import ConfigError
from rlcore.loading.loader import load_config, to_dict
from rlcore.errors import CheckpointError, DataError, RolloutError, RunStopped
from rlcore.plugins import PluginError, get_plugin_manager

console = Console()
err_console = Console(stderr=True)


def _plugins_data() -> list[dict]:
    manager = get_plugin_manager()
    by_dist: dict[str, dict] = {}
    for source in manager.sources:
        by_dist.setdefault(source.distribution, {
            "distribution": source.distribution, "version": source.version,
            "entry_points": [], "provides": {},
        })["entry_points"].append(source.entry_point)
    for reg in manager.iter_registrations():
        entry = by_dist[reg.source.distribution]
        entry["provides"].setdefault(reg.kind, []).append({
            "name": reg.name, "section": reg.section,
            "config": f"{reg.config_cls.__module__}.{reg.config_cls.__qualname__}" if reg.config_cls else None,
            "capabilities": reg.capabilities,
        })
    return list(by_dist.values())


def cmd_plugins(args) -> int:
    data = _plugins_data()
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    # One table per distribution, three columns that fold rather than cut: readable at 80 columns.
    # Capabilities (long, internal: import paths, precedences) are in --json.
    for dist in data:
        table = Table(title=f"{dist['distribution']} {dist['version']}", title_justify="left", expand=False)
        table.add_column("kind", overflow="fold")
        table.add_column("name", overflow="fold")
        table.add_column("recipe section", overflow="fold")
        for kind, items in dist["provides"].items():
            for item in items:
                table.add_row(kind.replace("_", " "), item["name"], item["section"] or "")
        console.print(table)
    console.print("capabilities and config classes: rlcore plugins --json", highlight=False, style="dim")
    return 0


def cmd_config(args) -> int:
    import yaml

    if args.defaults:
        from rlcore.loading.defaults import format_defaults, format_described, run_defaults

        defaults = run_defaults(get_plugin_manager())
        if args.json:
            print(json.dumps(defaults, indent=2, default=str))
        else:
            print(format_defaults(defaults) if args.no_descriptions else format_described(defaults, get_plugin_manager()), end="")
        return 0
    if args.recipe is None:
        raise ConfigError("", "rlcore config needs a recipe (or --defaults for the defaults of rlcore run)")
    config = load_config(args.recipe, args.overrides)
    from rlcore.controller.checks import check_before_start  # the run's package: loaded once a recipe is read

    check_before_start(config)  # what rlcore run refuses before it starts, refused here too
    resolved = to_dict(config)
    if args.json:
        print(json.dumps(resolved, indent=2, default=str))
    else:
        print(yaml.safe_dump(resolved, sort_keys=False, default_flow_style=None), end="")
    return 0


def cmd_recipes(args) -> int:
    from rlcore.loading.shipped import shipped_recipe, shipped_recipes, summary

    if args.name is None:
        found = shipped_recipes()
        if args.json:
            print(json.dumps({name: {"path": str(path), "about": summary(path)} for name, path in found.items()}, indent=2))
            return 0
        table = Table(title="recipes shipped with rlcore (rlcore run NAME; rlcore recipes NAME --out FILE copies one)",
                      title_justify="left")
        table.add_column("name", overflow="fold")
        table.add_column("what it runs", overflow="fold")
        for name, path in found.items():
            table.add_row(name, summary(path))
        console.print(table)
        return 0
    path = shipped_recipe(args.name)
    if path is None:
        raise ConfigError("", f"no shipped recipe named {args.name!r}; `rlcore recipes` lists them")
    if args.out is None:
        print(path.read_text(encoding="utf-8"), end="")
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError("", f"{out} exists; choose another --out or pass --force to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, out)
    print(f"wrote {out} (recipe {path.stem}); run it with: rlcore run {out}")
    return 0


def cmd_doctor(args) -> int:
    from rlcore.training.doctor import diagnose

    report = diagnose()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["supported"] else 1
    table = Table(title=f"rlcore doctor (python {report['python']}, stack: {report['stack']})")
    table.add_column("package")
    table.add_column("version")
    for name, ver in report["versions"].items():
        table.add_row(name, ver or "[dim]not installed[/dim]")
    cuda = report["cuda"]
    table.add_row("CUDA", f"{cuda['version']} ({cuda['devices']} devices)" if cuda["available"] else "not available")
    te = report["transformer_engine"]
    table.add_row("Transformer Engine extension", "loads" if te["loads"] else f"[dim]does not load: {te['error']}[/dim]")
    if te.get("cublaslt"):
        table.add_row("cuBLASLt (Transformer Engine's)", str(te["cublaslt"]))
    console.print(table)
    if report["supported"]:
        console.print("[green]This combination is supported.[/green]")
        return 0
    for problem in report["problems"]:
        console.print(f"[red]{problem['package']}[/red]: found {problem['found']}, expected {problem['expected']}. Fix: {problem['fix']}")
    return 1


def run_overrides(args) -> list[str]:
    """The recipe overrides of ``rlcore run``, with ``--resume/--no-resume`` and ``--verbose`` last (they win)."""
    extra = [] if args.resume is None else [f"checkpointing.resume={'true' if args.resume else 'false'}"]
    if getattr(args, "verbose", False):
        extra.append("logger.verbosity=verbose")
    return list(args.overrides) + extra


def cmd_run(args) -> int:
    import rlcore

    config = load_config(args.recipe, run_overrides(args))
    args.exit_timeout_s = config.cluster.exit_timeout_s  # from here on the run may leave threads behind (main)
    from rlcore.controller.checkpoint import INTERRUPTED, TERMINATED

    INTERRUPTED.clear()  # this run's signals only: an earlier run in this process (a sweep, a notebook) may have had one
    TERMINATED.clear()
    try:
        result = rlcore.run(config)
    except KeyboardInterrupt:
        return interrupted(config)
    except Exception as exc:
        if INTERRUPTED.is_set():  # a child process the terminal's Ctrl-C ended too: the interruption, not a failure
            return interrupted(config)
        if TERMINATED.is_set():  # a part in the process group the SIGTERM ended too: the stop it asked for
            return terminated(config, exc)
        raise
    stopped = result["summary"].get("stopped_by_signal")
    return 128 + signal.Signals[stopped].value if stopped else 0  # a shell's status for a run a signal ended


def interrupted(config) -> int:
    """One line for a run Ctrl-C stopped at once: what it saved and how to go on; exit 130."""
    err_console.print(f"interrupted (Ctrl-C): {saved_for_resume(config)}", highlight=False, markup=False, soft_wrap=True)
    return 128 + signal.SIGINT.value


def terminated(config, exc: BaseException) -> int:
    """One line for a run that SIGTERM stopped mid-step, a part of it ended by the same signal; exit 143."""
    cause = (str(exc).strip().splitlines() or [""])[-1][:200]
    err_console.print(f"SIGTERM received: the run stopped mid-step ({type(exc).__name__}: {cause}); "
                      f"{saved_for_resume(config)}", highlight=False, markup=False, soft_wrap=True)
    return 128 + signal.SIGTERM.value


def saved_for_resume(config) -> str:
    """What a stopped run kept and how to go on."""
    from rlcore.controller.checkpoint import CheckpointManager
    from rlcore.controller.run_dir import checkpoint_root, holds_records

    log_dir = config.logger.log_dir
    latest = CheckpointManager(checkpoint_root(config), keep_last_k=1).latest() if config.checkpointing.enabled else None
    if latest is not None:
        return f"newest checkpoint {latest}; run the same command again to resume from it"
    if not holds_records(log_dir, config):  # stopped before its first record: the directory takes a new run
        return "nothing saved yet; run the same command again to start afresh"
    # records, nothing to resume them from: a new run in that directory is refused (run_dir)
    why = "no checkpoint was written yet" if config.checkpointing.enabled else "checkpointing.enabled is false"
    return (f"nothing to resume from ({why}); its records stay in {log_dir}. To start afresh, delete them "
            f"(rm -r {shlex.quote(str(log_dir))}) or run again with logger.log_dir=<another directory>")


def start_exit_watchdog(timeout_s: float, status: int) -> threading.Thread:
    """Exit with ``status`` if this process is still alive ``timeout_s`` from now.

    Called once the run has ended, finished or failed: what follows is only the interpreter's exit,
    which waits for every non-daemon thread and runs every atexit handler, and one that never returns
    would keep an ended run's process (and its GPU memory) forever: a long GPU run can print its
    summary and then never exit. The stacks printed first show what it waited for; ``os._exit`` then skips the handlers that hang.
    """
    from rlcore.deadlines import exit_after

    return exit_after(timeout_s, status, lambda: f"the run has ended (status {status}), but its process did not exit "
                                                 f"within {timeout_s:g}s (cluster.exit_timeout_s)")


def cmd_export(args) -> int:
    from rlcore.cli.export import export_checkpoint
    from rlcore.controller.verbosity import apply_verbosity

    apply_verbosity("verbose" if args.verbose else "quiet")
    with stdout_to_stderr():
        done = export_checkpoint(args.checkpoint, args.out, args.overrides)
    if args.json:
        print(json.dumps(done, indent=2))
    else:
        console.print(f"exported {done['checkpoint']} ({done['backend']} backend, {done['precision']}) to {done['out']}",
                      highlight=False, soft_wrap=True)
    return 0


def cmd_eval(args) -> int:
    from rlcore.cli.evaluation import check_eval_options, evaluate, write_summary
    from rlcore.controller.verbosity import apply_verbosity

    check_eval_options(args.batch_size, args.out)  # before the evaluation, whose result a bad --out would lose
    apply_verbosity("verbose" if args.verbose else "quiet")
    with stdout_to_stderr():  # `rlcore eval ... > eval.json`: the JSON summary is all stdout gets
        summary = evaluate(args.model, args.recipe, args.overrides, k=args.k, num_samples=args.samples,
                           batch_size=args.batch_size, progress=not args.no_progress)
    print(write_summary(summary, args.out), flush=True)
    return 0


@contextlib.contextmanager
def stdout_to_stderr():
    """Everything written to stdout meanwhile goes to stderr: Python's ``print``, the libraries'
    log handlers bound to ``sys.stdout``, and the processes started meanwhile (vLLM's engine core
    writes to the file descriptor it inherits). Keeps stdout for a command's machine-readable result."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


VERBOSE_HELP = "also print the INFO logs and progress bars of vLLM, transformers, Ray (logger.verbosity=verbose)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rlcore", description="RL post-training of LLMs with pluggable backends.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run a recipe")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="dotted.key=value; ~dotted.key removes a key the recipe sets")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                   help="continue from this run's newest checkpoint (checkpointing.resume; default: the recipe's)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("plugins", help="list installed plugins and what they provide")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("config", help="print the resolved config of a recipe")
    p.add_argument("recipe", nargs="?")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--defaults", action="store_true",
                   help="print the defaults of rlcore run (core keys, each plugin's section), each with its description")
    p.add_argument("--no-descriptions", action="store_true", help="with --defaults: the values only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("recipes", help="list the recipes shipped with rlcore, print one, or copy it out (--out)")
    p.add_argument("name", nargs="?", help="a recipe's name: print it (or copy it to --out)")
    p.add_argument("--out", default=None, help="write the recipe to this file, to edit it")
    p.add_argument("--force", action="store_true", help="with --out: overwrite an existing file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_recipes)
    p = sub.add_parser("doctor", help="check installed versions")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("export", help="write an rlcore checkpoint as a Hugging Face model (safetensors, config, tokenizer)")
    p.add_argument("checkpoint", help="a step_N directory, a checkpoints directory (its newest) or a run's log_dir")
    p.add_argument("out", help="new or empty directory for the Hugging Face model")
    p.add_argument("overrides", nargs="*", help="dotted.key=value applied to the run's config (e.g. a moved policy.model_name)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("eval", help="greedy accuracy and pass@k of a model on a recipe's validation set (JSON summary)")
    p.add_argument("model", help="a Hugging Face model directory, or an rlcore checkpoint (exported first)")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="dotted.key=value applied to the recipe; ~dotted.key removes one")
    p.add_argument("--k", type=int, default=1, help="pass@k (unbiased estimator over --samples samples per prompt)")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt for pass@k (default: k)")
    p.add_argument("--batch-size", type=int, default=256, help="prompts per generate call")
    p.add_argument("--out", default=None, help="also write the JSON summary to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=cmd_eval)
    from rlcore.planning.command import add_parser as add_plan_parser

    add_plan_parser(sub)
    from rlcore.cli.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    from rlcore.cli.traces import add_parser as add_rollouts_parser

    add_rollouts_parser(sub)
    return parser


def install_stack_dump() -> None:
    """SIGUSR1 prints every thread's Python stack to stderr; the process goes on (the standard
    library's ``faulthandler``, so it works while the main thread waits in C code). It writes to the
    process's own stderr, ``sys.__stderr__``: a caller of :func:`main` in-process may have replaced
    ``sys.stderr`` with a stream that has no file descriptor."""
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, overrides anywhere after the recipe: argparse ends a command's ``overrides`` list at
    its first option, so ``rlcore run RECIPE --resume a.b=1`` would refuse ``a.b=1``; such late ``key=value``
    items join the overrides in order (a later one wins). Anything else left over is an error as before."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    late = [item for item in rest if "=" in item and not item.startswith("-")]
    if late and isinstance(getattr(args, "overrides", None), list):
        args.overrides = [*args.overrides, *late]
        rest = [item for item in rest if item not in late]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    install_stack_dump()
    args = parse(argv)
    status = 1  # an exception this does not catch
    try:
        status = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that left (BrokenPipeError) is handled below
        return status
    except BrokenPipeError:
        # `rlcore plugins --json | head`: the reader left; say nothing more (and let Python's
        # flush at exit find nothing to write: stdout now points at /dev/null).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
        return status
    except (ConfigError, PluginError, CheckpointError, DataError) as exc:
        # soft_wrap: never break the message (key paths, file paths) at the terminal width.
        err_console.print(f"error: {exc}", highlight=False, markup=False, style="bold red", soft_wrap=True)
        status = 2
        return status
    except RolloutError as exc:  # a hung or failing agent: the message names the trajectories, the traceback adds nothing
        err_console.print(f"error: {exc}", highlight=False, markup=False, style="bold red", soft_wrap=True)
        status = 1
        return status
    except RunStopped as exc:  # a timeout, non-finite losses: the message names what and where; no traceback
        err_console.print(f"error: {type(exc).__name__}: {exc}", highlight=False, markup=False, style="bold red",
                          soft_wrap=True)
        return status
    finally:
        # Once a run has begun (cmd_run sets the limit), its process is ended if it does not exit, but
        # only when this is the program's own command line (the `rlcore` script, `python -m rlcore.cli`):
        # a caller that passes argv in-process (a test, a notebook) goes on.
        if argv is None and getattr(args, "exit_timeout_s", None) is not None:
            start_exit_watchdog(args.exit_timeout_s, status)


if __name__ == "__main__":
    sys.exit(main())
