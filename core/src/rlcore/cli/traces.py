"""``rlcore rollouts RUN [--step N] [--worst | --best] [-n K]``: a run's rollout traces, readably.

RUN is a run's ``logger.log_dir`` (its traces file is ``rollouts.jsonl``, or the ``logger.rollouts.filename``
its saved config names) or a traces file. Each trace is shown as a panel: step, sample, reward,
advantage, policy version, the prompt's tail, the completion, the agent's tool calls and their
results, and failed attempts with their cause.
"""

from __future__ import annotations

from pathlib import Path

from rlcore.config.structure import ConfigError
from rlcore.errors import DataError
from rlcore.config.run_paths import inside
from rlcore.loggers.traces import read_traces, trace_path

_PROMPT_TAIL = 400  # characters of the prompt shown: its end, next to the completion


def find_traces(run: str) -> Path:
    """The traces file of ``run`` (a run directory or the file itself); an error naming what is missing."""
    path = Path(run)
    if path.is_file():
        return path
    if not path.is_dir():
        raise DataError(f"rlcore rollouts: {run} is neither a run directory (logger.log_dir) nor a traces file")
    from rlcore.config.traces import RolloutTracesConfig

    config = RolloutTracesConfig()
    saved = path / "config.yaml"
    if saved.is_file():  # the run's own file name, if its recipe changed it
        import yaml

        try:
            name = (yaml.safe_load(saved.read_text()) or {}).get("logger", {}).get("rollouts", {}).get("filename")
            config = RolloutTracesConfig(filename=name) if name else config
        except (yaml.YAMLError, AttributeError, TypeError, ValueError):
            pass
    found = trace_path(path, config)
    try:  # a link in a run directory someone handed over is never read through to a file outside it
        inside(path, config.filename, "logger.rollouts.filename")
    except ConfigError:
        raise DataError(f"rlcore rollouts: {found} leads out of the run directory {path} (to {found.resolve()}, "
                        "through a symbolic link); it was not read. Pass the traces file itself to read it") from None
    if not found.is_file():
        raise DataError(f"rlcore rollouts: {found} does not exist: the run wrote no traces "
                                "(logger.rollouts.enabled false, or no step finished yet)")
    return found


def select(records: list[dict], step: int | None, order: str | None, count: int) -> list[dict]:
    """The trajectory traces of ``step`` (every step when None), worst or best reward first, or
    in file order; at most ``count``. Failures and notes of the shown steps are kept after them."""
    shown = [r for r in records if step is None or r.get("step") == step]
    trajectories = [r for r in shown if r.get("kind") == "trajectory"]
    if order is not None:
        trajectories.sort(key=lambda r: r.get("reward", 0.0), reverse=order == "best")
    trajectories = trajectories[:count]
    rows = {(r["step"], r["row"]) for r in trajectories}
    segments = [r for r in shown if r.get("kind") == "segment" and (r["step"], r.get("segment_of")) in rows]
    others = [r for r in shown if r.get("kind") in ("failure", "note")]
    return trajectories + segments + others


def _turns(turns) -> list[str]:
    """Rich markup lines of an agent's tool calls and tool results, request by request."""
    from rich.markup import escape

    if not isinstance(turns, list):
        return [escape(str(turns))]
    lines = []
    for turn in turns:
        for message in turn.get("messages") or ():
            if message.get("role") == "tool":
                lines.append(f"[cyan]tool result[/cyan] ({escape(str(message.get('tool_call_id', '')))}): "
                             f"{escape(str(message.get('content', '')))}")
        for call in turn.get("tool_calls") or ():
            fn = call.get("function", {})
            lines.append(f"[magenta]tool call[/magenta] {escape(str(fn.get('name')))}({escape(str(fn.get('arguments')))}) "
                         f"id {escape(str(call.get('id')))}")
    return lines


def render(record: dict):
    """One trace as a rich renderable."""
    from rich.markup import escape
    from rich.panel import Panel
    from rich.text import Text

    kind = record.get("kind")
    if kind in ("failure", "note"):
        body = record.get("error") or record.get("note") or ""
        title = f"step {record.get('step')} {kind}" + (f": {record.get('cause')} ({record.get('trajectory')})" if kind == "failure" else "")
        return Panel(Text(str(body)), title=title, border_style="red" if kind == "failure" else "yellow")
    head = (f"step {record['step']} · sample {record.get('sample')} · reward {record.get('reward'):g} · "
            f"advantage {record.get('advantage', 0.0):+.3f} · policy v{record.get('policy_version')} · "
            f"{len(record.get('response_ids', ())) or '?'} tokens · {record.get('finish_reason')}")
    if kind == "segment":
        head = f"earlier segment of row {record.get('segment_of')} · " + head
    prompt = str(record.get("prompt", ""))
    lines = [f"[dim]{escape(('…' if len(prompt) > _PROMPT_TAIL else '') + prompt[-_PROMPT_TAIL:])}[/dim]",
             f"[bold]{escape(str(record.get('completion', '')))}[/bold]"]
    lines += _turns(record.get("turns") or [])
    if record.get("env_metrics"):
        lines.append("[dim]" + escape(" ".join(f"{k}={v:g}" for k, v in record["env_metrics"].items())) + "[/dim]")
    if record.get("tokens_omitted"):
        lines.append("[yellow](per-token lists left out: over logger.rollouts.max_step_bytes)[/yellow]")
    reward = record.get("reward", 0.0)
    return Panel("\n".join(lines), title=head, title_align="left", border_style="green" if reward > 0 else "blue")


def cmd_rollouts(args) -> int:
    from rich.console import Console

    path = find_traces(args.run)
    records = list(read_traces(path))
    steps = sorted({r["step"] for r in records if isinstance(r.get("step"), int)})
    step = args.step if args.step is not None or not steps or args.all_steps else steps[-1]
    if step is not None and step not in steps:
        raise DataError(f"rlcore rollouts: no traces of step {step} in {path} (traced steps: "
                         f"{', '.join(map(str, steps[:5]))}{' ...' if len(steps) > 5 else ''}{' ' + str(steps[-1]) if len(steps) > 5 else ''})")
    console = Console()
    shown = select(records, step, "worst" if args.worst else "best" if args.best else None, args.n)
    for record in shown:
        console.print(render(record))
    count = sum(r.get("kind") == "trajectory" for r in shown)
    console.print(f"[dim]{count} {'trajectory' if count == 1 else 'trajectories'} of "
                  f"{'every step' if step is None else f'step {step}'} from {path} ({len(steps)} steps traced)[/dim]")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("rollouts", help="print a run's rollout traces (prompt, completion, reward, tool calls, failures)")
    p.add_argument("run", help="a run's logger.log_dir, or its traces file")
    p.add_argument("--step", type=int, default=None, help="the step to show (default: the last traced)")
    p.add_argument("--all-steps", action="store_true", help="every traced step")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--worst", action="store_true", help="lowest reward first")
    order.add_argument("--best", action="store_true", help="highest reward first")
    p.add_argument("-n", type=int, default=8, help="trajectories to show (default 8)")
    p.set_defaults(func=cmd_rollouts)
