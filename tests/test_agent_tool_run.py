"""An agent that calls a calculator through OpenAI ``tools`` trains end to end (``python -m rlcore.cli.demo
--tools``'s pieces, small): a tiny Llama given the tools-aware tiny template and the tool-call warm
start (:mod:`rlcore.cli.demo_tools`), then GRPO through the agents' endpoint with
``examples/agents/math_tool_agent.py:agent`` (the ``openai`` client alone; hf generator). Every step's
record counts the tool calls the endpoint parsed and the agent ran, and the rollout traces show each
call and the result the agent sent back, as ``rlcore rollouts`` prints them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlcore

pytest.importorskip("fastapi")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
AGENT = f"{ROOT / 'examples' / 'agents' / 'math_tool_agent.py'}:agent"


def _config(model: Path, run_dir: Path):
    return rlcore.build_config({
        "policy": {"model_name": str(model), "precision": "float32", "max_total_sequence_length": 128,
                   "optimizer": {"lr": 1e-4, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True},
                   "generation": {"backend": "hf", "max_new_tokens": 64, "temperature": 1.0}},
        "algorithm": {"name": "grpo"},
        "data": {"name": "arithmetic", "digits": 1, "num_validation": 4, "num_train": 256},
        "env": {"name": "agent", "agent": {"function": AGENT, "max_turns": 4}},
        "train": {"num_prompts_per_step": 4, "max_num_steps": 2, "val_period": 0, "val_at_start": False, "seed": 3},
        "grpo": {"num_generations_per_prompt": 4},
        "logger": {"log_dir": str(run_dir), "print_table": False, "plot": False, "jsonl": {"enabled": True},
                   "rollouts": {"per_step": 16}},
    })


@pytest.mark.slow
def test_the_calculator_agent_calls_its_tool_in_every_step_and_the_traces_show_call_and_result(tmp_path):
    from rlcore.cli.demo import sft_config
    from rlcore.cli.demo_tools import tool_warm_start
    from rlcore.testing.tiny import build_tiny_model

    base = build_tiny_model(tmp_path / "base", "llama", hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1,
                            intermediate_size=128, max_positions=128)
    warm = tmp_path / "warm"
    # the format is learnt in a few dozen steps by a model this small; target 1.0: all 60 steps, one held-out check
    recipe = _config(base, tmp_path / "unused")
    tool_warm_start(base, warm, recipe, sft_config(recipe, base, lr=5e-3, warmup=0), target=1.0, max_steps=60,
                    batch_size=16, eval_every=60)
    checked = json.loads((warm / "tool_warm_start.json").read_text())["history"]
    assert [h["step"] for h in checked] == [60] and checked[0]["calls"] > 0, checked  # the held-out calls, as parsed
    run_dir = tmp_path / "run"
    rlcore.run(_config(warm, run_dir))

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "env/tool_calls" in r]
    assert len(steps) == 2 and all(r["env/tool_calls"] > 0 for r in steps), steps
    assert all(r["env/agent_tool_calls"] > 0 for r in steps)  # the endpoint's count of the calls it parsed

    traces = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    shown = 0
    for trace in (t for t in traces if t["kind"] == "trajectory"):
        turns = trace["turns"]
        for turn, after in zip(turns, turns[1:]):
            for call in turn.get("tool_calls") or ():
                expression = json.loads(call["function"]["arguments"]).get("expression", "")
                results = [m for m in after["messages"] if m["role"] == "tool" and m["tool_call_id"] == call["id"]]
                assert len(results) == 1, after
                # the agent sent back the calculator's value of what the model asked for
                if expression.replace("+", "").isdigit() and expression.count("+") == 1:
                    assert results[0]["content"] == str(sum(int(x) for x in expression.split("+")))
                assert f"<|tool|>{results[0]['content']}" in trace["prompt"] + trace["completion"]
                shown += 1
    assert shown > 0

    printed = subprocess.run([str(Path(sys.executable).parent / "rlcore"), "rollouts", str(run_dir), "--all-steps", "--best"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert printed.returncode == 0, printed.stderr
    assert "tool call calc(" in printed.stdout and "tool result" in printed.stdout


def test_every_warm_start_conversation_calls_the_tool_and_trains_the_call_and_the_answer():
    """The tool-call warm start's data never answers directly: each conversation calls the calculator with the
    problem's expression, gets its value back, and answers with it; the call and the answer are trained,
    the prompt and the tool's result are not."""
    from rlcore.cli.demo_tools import conversation_batch, tool_conversation
    from rlcore.plugins import get_plugin_manager
    from rlcore.testing.tiny import build_tokenizer
    from rlcore_math.config import ArithmeticDatasetConfig

    spec = importlib.util.spec_from_file_location("math_tool_agent", ROOT / "examples" / "agents" / "math_tool_agent.py")
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    tokenizer = build_tokenizer(tools=True)
    data = ArithmeticDatasetConfig(digits=2, operations=("+",), num_validation=8, num_train=64)
    train = get_plugin_manager().get("dataset", "arithmetic").build(data, tokenizer).train
    conversations = [tool_conversation(sample, agent.TOOLS[0]["function"]) for sample in train]
    batch = conversation_batch(conversations, tokenizer, agent.TOOLS)
    call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    for sample, ids, mask in zip(train, batch.input_ids, batch.loss_mask):
        trained = tokenizer.decode([int(t) for t, m in zip(ids, mask) if m])
        untrained = tokenizer.decode([int(t) for t, m in zip(ids, mask) if not m])
        expression = sample.metadata["expr"]
        assert trained == (f'<tool_call>{{"name":"calc","arguments":{{"expression":"{expression}"}}}}</tool_call></s>'
                           f"{sample.answer}</s>"), trained
        assert untrained.endswith(f"{expression}=<|assistant|><|tool|>{sample.answer}<|assistant|>"), untrained
        assert int(ids.tolist().count(call_id)) == 1
        assert agent.calculate(expression) == str(sample.answer)  # the tool's result is the answer trained on


def test_a_recorded_tools_demo_row_carries_the_tool_call_warm_start(tmp_path):
    """``python -m rlcore.cli.demo --tools --record``: the row names the mode and carries the tool-call SFT's
    last held-out check (steps, seconds, the shares of calls, right arguments and answers)."""
    from rlcore.cli.demo import build_parser, demo_row, recorded_variant

    check = {"step": 60, "loss": 0.04, "calls": 1.0, "arguments": 0.62, "answers": 0.88, "seconds": 70.0}
    (tmp_path / "tool_warm_start.json").write_text(json.dumps({"target": 0.6, "tool_every": 1, "history": [check]}))
    summary = {"val/accuracy_first": 0.6, "val/accuracy_last": 0.8, "steps": 30, "run_id": "r"}
    variant = recorded_variant(build_parser().parse_args(["--tools"]), [])
    row = demo_row(summary, 400.0, tmp_path, "recipes/grpo_agent_tool_arith_tiny_cpu.yaml", variant)
    assert row["variant"] == "--tools" and row["config"] == "grpo_agent_tool_arith_tiny_cpu"
    assert {k: row[k] for k in row if k.startswith("tool_sft_")} == {f"tool_sft_{k}": v for k, v in check.items()}
    assert row["sft_steps"] is None  # no demo SFT history in the tool warm start's directory
