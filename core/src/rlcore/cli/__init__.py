"""The ``rlcore`` command and its tools: run, plan, export, evaluation, traces, demo, bench and the docs reference; may import every package but runtime."""


def main(argv: list[str] | None = None) -> int:
    """The ``rlcore`` command (its console script names this; the commands live in :mod:`rlcore.cli.commands`)."""
    from rlcore.cli.commands import main as run_command

    return run_command(argv)
