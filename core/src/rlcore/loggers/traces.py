"""Rollout traces: what each step generated, rewarded and trained, one JSON line per sequence.

A reward that never fires, an agent that loops on a tool, a mask that covers the wrong tokens: all
are read from the rollouts themselves. After each training step, a sample of the step's
trajectories (``logger.rollouts.per_step``, spread over the rewards from the worst to the best)
is written to ``<logger.log_dir>/rollouts.jsonl``, each line taken from the training batch itself,
so a trace is exactly what was trained:

- ``prompt_ids``, ``response_ids`` (the batch row, cut where the batch cut it), ``loss_mask``,
  ``sampling_logprobs`` (the generator's) and ``trainer_logprobs`` (the trainer's ``old_logprobs``,
  when the algorithm computes them) over the response, as float32 values written in their
  shortest exact form; ``advantage`` (and ``advantages`` per token where they differ, as a
  critic's do), ``reward``, ``env_metrics``;
- ``prompt`` and ``completion`` texts (the ids decoded, template tokens kept), ``policy_version``
  (the generator's weights version the sequence was sampled with: a sequence is generated within
  one batch, under the generator's lock, so all its tokens share it), ``finish_reason``;
- for agents (:mod:`rlcore.agents`): ``turns`` (each request's new messages, tool results among
  them, its reply and tool calls), earlier ``segment`` rows of a rewritten history (``kind:
  segment``, ``segment_of`` the trajectory's row), and each failed attempt (``kind: failure``,
  with its ``cause`` and error).

Bounds: a step's lines take at most ``max_step_bytes`` (a trajectory over what is left keeps its
texts and scores, without its per-token lists: ``tokens_omitted``), the file at most
``max_run_bytes`` (then one ``note`` line, and no more steps). A resumed run drops the lines of
the steps after its checkpoint: they are redone. ``rlcore rollouts RUN`` prints them
(:mod:`rlcore.cli.traces`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlcore.config.traces import RolloutTracesConfig
from rlcore.config.run_paths import append_whole, inside, write_file

TEXT_LIMIT = 4000  # characters of a text kept in a slimmed (over-budget) trace
_NOTE_RESERVE = 400  # bytes kept back from max_run_bytes for the line that says the budget ran out


def trace_path(log_dir: str | Path, config: RolloutTracesConfig) -> Path:
    """The traces file of the run in ``log_dir`` (the one place that decides it)."""
    return Path(log_dir) / config.filename


def spread(scores: Sequence[float], k: int) -> list[int]:
    """Indices of ``k`` entries spread evenly over ``scores`` sorted ascending (the lowest and the
    highest included), in that order; all of them when there are no more than ``k``."""
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    if len(order) <= k:
        return order
    if k == 1:
        return [order[-1]]
    picks = dict.fromkeys(order[round(j * (len(order) - 1) / (k - 1))] for j in range(k))
    return list(picks)


def _f32(values) -> list[float]:
    """float32 values as the shortest decimals that read back to the same float32."""
    return [float(str(v)) for v in np.asarray(values, dtype=np.float32)]


def _ints(values) -> list[int]:
    return [int(v) for v in np.asarray(values).tolist()]


def _row(batch, row: int, prompt_len: int) -> dict[str, Any]:
    """The per-token fields of one batch row, over its response (what the loss saw)."""
    ids = _ints(batch.input_ids[row])
    start = min(prompt_len, len(ids))
    out: dict[str, Any] = {"prompt_ids": ids[:start], "response_ids": ids[start:],
                           "loss_mask": _ints(np.asarray(batch.loss_mask[row])[start:]),
                           "sampling_logprobs": _f32(batch.token_fields["gen_logprobs"][row][start:])}
    if "old_logprobs" in batch.token_fields:
        out["trainer_logprobs"] = _f32(batch.token_fields["old_logprobs"][row][start:])
    advantage = float(batch.seq_fields["advantages"][row])
    per_token = _f32(batch.token_fields["advantages"][row][start:])
    out["advantage"] = float(str(np.float32(advantage)))
    if any(a != out["advantage"] for a in per_token):  # a critic's per-token advantages
        out["advantages"] = per_token
    return out


class TraceBuilder:
    """Trace records of one step from its trajectories and the batch they trained as."""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    def _text(self, ids: list[int], fallback: Any) -> str:
        if self.tokenizer is not None:
            try:
                return self.tokenizer.decode(ids, skip_special_tokens=False)
            except Exception:  # noqa: BLE001 - a trace is never worth a failed step
                pass
        return fallback if isinstance(fallback, str) else json.dumps(fallback, default=str)

    def _sequence(self, step: int, kind: str, row: int, traj, result, batch) -> dict[str, Any]:
        fields = _row(batch, row, len(result.prompt_ids))
        record: dict[str, Any] = {
            "step": step, "kind": kind, "row": row, "sample": traj.sample.index, "group": traj.group,
            "reward": float(traj.reward), "policy_version": int(result.policy_version), "finish_reason": result.finish_reason,
            "num_turns": int(result.num_turns), "env_metrics": {k: float(v) for k, v in traj.env_metrics.items()},
            "prompt": self._text(fields["prompt_ids"], traj.sample.prompt),
            "completion": self._text(fields["response_ids"], result.text),
        }
        if result.turns:
            record["turns"] = result.turns
        record.update(fields)
        return record

    def records(self, step: int, trajectories: list, batch, picks: Sequence[int],
                failures: Sequence[dict] = ()) -> list[dict]:
        """The records of trajectories ``picks`` (indices into ``trajectories``, the batch's first
        rows), each followed by its earlier segments (the rows after the trajectories, in order),
        then ``failures``."""
        first_segment_row, segment_rows = len(trajectories), {}
        for i, traj in enumerate(trajectories):
            count = len(traj.result.segments or ())
            segment_rows[i] = range(first_segment_row, first_segment_row + count)
            first_segment_row += count
        out = []
        for i in picks:
            traj = trajectories[i]
            out.append(self._sequence(step, "trajectory", i, traj, traj.result, batch))
            for row, segment in zip(segment_rows[i], traj.result.segments or ()):
                out.append({**self._sequence(step, "segment", row, traj, segment, batch), "segment_of": i})
        out.extend({"step": step, "kind": "failure", **failure} for failure in failures)
        return out


def _slim(record: dict) -> dict:
    """The record without its per-token lists, its texts cut to :data:`TEXT_LIMIT` characters."""
    out = {k: v for k, v in record.items() if not isinstance(v, list) or k == "turns"}
    for key in ("prompt", "completion", "error"):
        if isinstance(out.get(key), str) and len(out[key]) > TEXT_LIMIT:
            out[key] = out[key][:TEXT_LIMIT] + f"... [{len(out[key]) - TEXT_LIMIT} more characters]"
    if "turns" in out and len(json.dumps(out["turns"])) > TEXT_LIMIT:
        out["turns"] = f"[{len(record['turns'])} turns left out: over logger.rollouts.max_step_bytes]"
    out["tokens_omitted"] = True
    return out


def fit(records: Sequence[dict], max_bytes: int) -> tuple[list[bytes], int]:
    """JSON lines of ``records`` within ``max_bytes`` (whole ones first, slimmed ones where a whole
    one does not fit), and how many records did not fit at all."""
    lines, used, left_out = [], 0, 0
    for record in records:
        line = (json.dumps(record) + "\n").encode()
        if used + len(line) > max_bytes:
            line = (json.dumps(_slim(record)) + "\n").encode()
        if used + len(line) > max_bytes:
            left_out += 1
            continue
        lines.append(line)
        used += len(line)
    return lines, left_out


class RolloutTraces:
    """The run's traces file (``logger.rollouts``), and the tables of a few traces per step for
    the loggers that show them (:class:`rlcore.interfaces.RolloutTableLogger`)."""

    def __init__(self, config: RolloutTracesConfig, log_dir: str | Path, tokenizer: Any = None,
                 table_loggers: Sequence[Any] = (), timeout_s: float | None = None):
        self.config, self.timeout_s = config, timeout_s  # timeout_s bounds each logger's table call (cluster.timeout_s)
        self.path, self.log_dir = trace_path(log_dir, config), log_dir
        self.builder = TraceBuilder(tokenizer)
        self.table_loggers = list(table_loggers)
        self._fd = -1
        self._full = False

    def _open(self) -> int:
        if self._fd < 0:
            inside(self.log_dir, self.config.filename, "logger.rollouts.filename", file=True)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._full = _ends_full(self.path)  # a resumed run's file that ran out already
        return self._fd

    def write(self, step: int, trajectories: list, batch, failures: Sequence[dict] = ()) -> list[dict]:
        """Trace a sample of the step's ``trajectories`` as trained in ``batch`` (and its failed
        attempts); return the records written."""
        from rlcore.deadlines import bounded_call  # the run's; `rlcore rollouts` reads traces without it

        if batch is None or not trajectories or not (self.config.enabled or self.table_loggers):
            return []
        picks = spread([t.reward for t in trajectories], self.config.per_step)
        records = self.builder.records(step, trajectories, batch, picks, failures)
        if self.config.enabled:
            self._append(step, records)
        rows = table(records, self.config.table_rows)
        for logger in self.table_loggers:  # a logger's network call that hangs stops the run, naming it
            bounded_call(lambda lg=logger: lg.log_rollouts(rows, step), f"logger {type(logger).__name__} (log_rollouts)",
                         self.timeout_s, step)
        return records

    def _append(self, step: int, records: list[dict]) -> None:
        if self._full:
            return
        fd = self._open()
        if self._full:
            return
        room = self.config.max_run_bytes - os.fstat(fd).st_size - _NOTE_RESERVE
        if room <= 0:  # full already (a resumed run's file): its note is there
            self._full = True
            return
        lines, left_out = fit(records, min(self.config.max_step_bytes, room))
        if left_out and room < self.config.max_step_bytes:
            self._full = True
            note = {"step": step, "kind": "note", "full": True, "note": f"logger.rollouts.max_run_bytes ({self.config.max_run_bytes}) "
                                                          "reached: no later step is traced"}
            lines.append((json.dumps(note) + "\n").encode())
        elif left_out:
            lines.append((json.dumps({"step": step, "kind": "note", "note": f"{left_out} traces over "
                                      "logger.rollouts.max_step_bytes left out"}) + "\n").encode())
        if lines:
            append_whole(fd, b"".join(lines), self.path, f"the rollout traces of step {step}")

    def resume_at(self, step: int) -> None:
        """Keep the traces of steps up to ``step`` (the checkpoint resumed from): later ones are redone."""
        if not self.path.is_file():
            return
        kept = [line + "\n" for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines()
                if _step_of(line) is not None and _step_of(line) <= step]
        write_file(self.path, "".join(kept), "the rollout traces kept on resume")
        self.close()  # the file it was open on is replaced
        self._full = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _ends_full(path: Path) -> bool:
    """Whether the file's last line is the note that says ``max_run_bytes`` was reached."""
    with open(path, "rb") as handle:
        handle.seek(max(0, handle.seek(0, os.SEEK_END) - _NOTE_RESERVE))
        lines = handle.read().splitlines()
    try:
        return bool(lines) and json.loads(lines[-1]).get("full") is True
    except ValueError:
        return False


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None  # a line cut off by a crash
    return step if isinstance(step, int) else None


TABLE_COLUMNS = ("sample", "reward", "advantage", "prompt", "completion")


def table(records: Sequence[dict], rows: int) -> list[list]:
    """``rows`` trajectory traces spread from the worst reward to the best, as table rows of
    :data:`TABLE_COLUMNS` (texts cut to 500 characters)."""
    trajectories = [r for r in records if r.get("kind") == "trajectory"]
    picks = spread([r["reward"] for r in trajectories], rows) if rows else []
    return [[trajectories[i]["sample"], trajectories[i]["reward"], trajectories[i].get("advantage"),
             trajectories[i]["prompt"][-500:], trajectories[i]["completion"][:500]] for i in picks]


def read_traces(path: str | Path) -> Iterator[dict]:
    """The records of a traces file, skipping a line cut off by a crash."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record
