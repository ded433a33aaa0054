"""Rollout traces (rlcore.loggers.traces): which trajectories a step traces, the byte bounds per step and
per run, resume, the tables for TensorBoard, and ``rlcore rollouts``."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from rlcore.config.traces import RolloutTracesConfig
from rlcore.generation.batching import Trajectory, to_sequence_batch
from rlcore.interfaces import GenerationResult, Sample
from rlcore.loggers.traces import RolloutTraces, read_traces, spread, table


def _step(rng: random.Random, n: int, prompt_len: int, response_len: int, max_len: int):
    """``n`` trajectories (4 per group) with random ids and logprobs, and their training batch."""
    trajs = []
    for i in range(n):
        result = GenerationResult(prompt_ids=[rng.randrange(50) for _ in range(prompt_len)],
                                  response_ids=[rng.randrange(50) for _ in range(response_len)],
                                  response_logprobs=[-rng.random() * 3 for _ in range(response_len)],
                                  finish_reason="stop", text="x" * response_len, policy_version=3)
        trajs.append(Trajectory(Sample(prompt_ids=result.prompt_ids, prompt=f"{i}+1=", answer=str(i + 1), index=i),
                                i // 4, result, reward=float(rng.random() < 0.5)))
    advantages_N = torch.tensor([t.reward - 0.5 for t in trajs])
    return trajs, to_sequence_batch(trajs, advantages_N, max_len)


def test_spread_takes_the_worst_and_the_best_and_keeps_order():
    scores = [0.5, 0.1, 0.9, 0.3, 0.7]
    assert spread(scores, 2) == [1, 2] and spread(scores, 3) == [1, 0, 2]
    assert spread(scores, 9) == [1, 3, 0, 4, 2]


def test_a_demo_sized_run_of_240_steps_stays_under_50_mb(tmp_path):
    """The CPU demo's shape (32 prompts x 8 samples, sequences of 64 tokens) with the default bounds."""
    rng, config = random.Random(0), RolloutTracesConfig()
    traces = RolloutTraces(config, tmp_path)
    step_bytes = []
    for step in range(1, 241):
        trajs, batch = _step(rng, 32, 40, 24, 64)
        before = traces.path.stat().st_size if traces.path.exists() else 0
        written = traces.write(step, trajs, batch)
        step_bytes.append(traces.path.stat().st_size - before)
        assert sum(r["kind"] == "trajectory" for r in written) == config.per_step
    traces.close()
    assert max(step_bytes) <= config.max_step_bytes and traces.path.stat().st_size <= 50_000_000
    assert 240 * config.max_step_bytes <= config.max_run_bytes <= 50_000_000  # whatever a step holds, 240 fit
    assert not [r for r in read_traces(traces.path) if r["kind"] == "note" or r.get("tokens_omitted")]


def test_the_run_bound_stops_tracing_with_a_note_and_the_step_bound_slims(tmp_path):
    config = RolloutTracesConfig(per_step=4, max_step_bytes=6_000, max_run_bytes=60_000)
    traces, rng = RolloutTraces(config, tmp_path), random.Random(1)
    for step in range(1, 241):
        trajs, batch = _step(rng, 8, 20, 150, 400)  # ~2.5 kB a trajectory: two fit a step whole
        traces.write(step, trajs, batch)
    traces.close()
    size = traces.path.stat().st_size
    records = list(read_traces(traces.path))
    notes = [r for r in records if r["kind"] == "note"]
    assert size <= config.max_run_bytes
    assert len(notes) == 1 and "max_run_bytes" in notes[0]["note"] and records[-1] is not None
    assert max(r["step"] for r in records) == notes[0]["step"]  # nothing traced after the note
    slim = [r for r in records if r.get("tokens_omitted")]
    assert slim and all("response_ids" not in r and r["prompt"] and "reward" in r for r in slim)
    by_step: dict[int, int] = {}
    for line in traces.path.read_bytes().splitlines(keepends=True):
        by_step[json.loads(line)["step"]] = by_step.get(json.loads(line)["step"], 0) + len(line)
    assert max(by_step.values()) <= config.max_step_bytes + 200  # the note line of the last step aside
    # a run that resumes in a full file writes nothing more
    again = RolloutTraces(config, tmp_path)
    again.write(241, *_step(rng, 8, 20, 150, 400))
    again.close()
    assert traces.path.stat().st_size == size


def test_resume_drops_the_traces_of_redone_steps(tmp_path):
    traces, rng = RolloutTraces(RolloutTracesConfig(per_step=2), tmp_path), random.Random(2)
    for step in (1, 2, 3):
        traces.write(step, *_step(rng, 8, 5, 5, 32))
    with open(traces.path, "a") as handle:
        handle.write('{"step": 4, "kind": "traj')  # cut off by a kill
    traces.resume_at(2)
    traces.write(3, *_step(rng, 8, 5, 5, 32))
    traces.close()
    assert [r["step"] for r in read_traces(traces.path)] == [1, 1, 2, 2, 3, 3]


def test_disabled_traces_write_nothing_but_still_feed_tables(tmp_path):
    class Tables:
        def __init__(self):
            self.rows = []

        def log_rollouts(self, rows, step):
            self.rows.append((step, rows))

    shown = Tables()
    traces = RolloutTraces(RolloutTracesConfig(enabled=False, table_rows=2), tmp_path, table_loggers=[shown])
    trajs, batch = _step(random.Random(3), 8, 5, 5, 32)
    traces.write(1, trajs, batch)
    assert not traces.path.exists()
    (step, rows), = shown.rows
    assert step == 1 and len(rows) == 2 and rows[0][1] <= rows[1][1]  # worst, best
    assert rows == table(traces.builder.records(1, trajs, batch, spread([t.reward for t in trajs], 8)), 2)


def test_tensorboard_logger_writes_the_table(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlcore.loggers.config import TensorboardLoggerConfig
    from rlcore.loggers.tensorboard import TensorboardLogger

    logger = TensorboardLogger(TensorboardLoggerConfig(enabled=True), tmp_path)
    logger.log_rollouts([[7, 1.0, 0.5, "7+1=", "8 | done\nok"]], 3)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("rollouts/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "| sample | reward |" in text and "8 \\| done⏎ ok" in text


def test_rlcore_rollouts_prints_the_worst_first_and_names_what_is_missing(tmp_path, capsys):
    from rlcore.cli.commands import main

    traces, rng = RolloutTraces(RolloutTracesConfig(per_step=4), tmp_path), random.Random(4)
    for step in (1, 2):
        traces.write(step, *_step(rng, 8, 5, 5, 32), failures=[{"sample": 3, "trajectory": "sample 3, trajectory 1, attempt 0",
                                                                 "cause": "timeout", "error": "the agent did not finish"}])
    traces.close()
    assert main(["rollouts", str(tmp_path), "--worst", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("step 2 · sample") == 2 and "step 1 ·" not in out and "timeout" in out and "did not finish" in out
    assert main(["rollouts", str(tmp_path), "--best", "-n", "4"]) == 0
    rewards = [float(word) for word in re.findall(r"· reward (\S+) ·", capsys.readouterr().out)]
    assert len(rewards) == 4 and rewards == sorted(rewards, reverse=True) and rewards[0] > rewards[-1]
    assert main(["rollouts", str(tmp_path), "--step", "9"]) == 2
    assert "no traces of step 9" in capsys.readouterr().err
    assert main(["rollouts", str(tmp_path / "nowhere")]) == 2


def test_rlcore_rollouts_reads_no_link_out_of_the_run_directory(tmp_path, outside_dir, capsys):
    from rlcore.cli.commands import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rollouts.jsonl").symlink_to(outside_dir / "keep.txt")
    assert main(["rollouts", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "leads out of the run directory" in err and "keep me" not in err


def test_per_token_advantages_are_traced_where_they_differ(tmp_path):
    """A critic's advantages (ppo) vary along the response: the trace keeps them token by token."""
    trajs, batch = _step(random.Random(5), 4, 3, 4, 32)
    batch.token_fields["advantages"][1] = torch.tensor([0.0] * 3 + [0.25, -0.5, 1.0 / 3.0, 2.0])
    records = RolloutTraces(RolloutTracesConfig(), tmp_path).builder.records(1, trajs, batch, [0, 1])
    assert "advantages" not in records[0]
    assert torch.equal(torch.tensor(records[1]["advantages"], dtype=torch.float32), batch.token_fields["advantages"][1][3:])


def test_rlcore_rollouts_shows_an_agents_tool_calls_and_results_as_text(tmp_path, capsys):
    from rlcore.cli.commands import main

    call = {"id": "call-1-0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "12*7"}'}}
    record = {"step": 5, "kind": "trajectory", "row": 0, "sample": 17, "group": 0, "reward": 1.0, "advantage": 0.5,
              "policy_version": 4, "finish_reason": "stop", "prompt": "What is 12*7?", "completion": "[84] is the answer",
              "turns": [{"request": 1, "messages": [{"role": "user", "content": "What is 12*7?"}], "reply": "", "tool_calls": [call]},
                        {"request": 2, "messages": [{"role": "tool", "tool_call_id": "call-1-0", "content": "[bold]84"}]}]}
    (tmp_path / "traces.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["rollouts", str(tmp_path / "traces.jsonl")]) == 0
    out = capsys.readouterr().out
    assert 'tool call calc({"expression": "12*7"}) id call-1-0' in out
    assert "tool result (call-1-0): [bold]84" in out and "[84] is the answer" in out  # text, never markup
