"""Token in, token out through the agents' endpoint, for the Llama 3, Llama 3.1, Qwen2 and Qwen3 chat templates.

An agent written with the ``openai`` client talks to the real endpoint (FastAPI under uvicorn on
loopback); the engine behind it writes fixed turns as vLLM returns them (the ids hold a stop string
and the EOS token it wrote, the text holds neither), so every token it produced is known. For
every trajectory: its trainable tokens (loss mask 1) are exactly the engine's, token for token,
with the engine's logprobs; every prompt the engine was fed is a prefix of the trajectory's
segment (nothing earlier was re-tokenized); a rewritten history (compaction, Qwen3's dropped
``<think>``) starts a new segment whose prompt is the template of the rewritten messages.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from rlcore.config.agents import AgentEnvConfig
from rlcore.agents.runner import AgentRunner, resolve_agent
from rlcore.interfaces import GenerationResult, Sample, SamplingParams
from rlcore.testing.chat_tokenizers import build_chat_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("openai")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
EOS = {"llama3": "<|eot_id|>", "llama31": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>"}
# templates with tool support; "tiny": rlcore.testing.tiny's character-level tokenizer with its tools template
TOOL_FAMILIES = ("llama31", "qwen2", "qwen3", "tiny")
TINY_EOS = "</s>"
SYSTEM = "You are a helpful assistant."
QUESTION = "What is 12*7+16? Put your final answer within \\boxed{}."
TOOL_TURNS = ['<tool_call>\n{"name": "calc", "arguments": {"expression": "12*7"}}\n</tool_call>',
              '<tool_call>\n{"name": "calc", "arguments": {"expression": "84+16"}}\n</tool_call>',
              "So the answer is \\boxed{100}."]
TINY_TOOL_TURNS = ['<tool_call>{"name":"calc","arguments":{"expression":"12*7"}}</tool_call>',
                   '<tool_call>{"name":"calc","arguments":{"expression":"84+16"}}</tool_call>', "So the answer is \\boxed{100}."]
LLAMA_TOOL_TURNS = ['{"name": "calc", "parameters": {"expression": "12*7"}}', '{"name": "calc", "parameters": {"expression": "84+16"}}',
                    "So the answer is \\boxed{100}."]
CALC_TURNS = ["Let me compute 12*7 first. <calc>12*7</calc>", "Then add 16: <calc>84+16</calc>", "So the answer is \\boxed{100}."]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_tokenizers")
    from transformers import AutoTokenizer

    from rlcore.testing.tiny import build_tokenizer

    build_tokenizer(tools=True).save_pretrained(root / "tiny")
    return {**{family: build_chat_tokenizer(family, root / family) for family in EOS},
            "tiny": AutoTokenizer.from_pretrained(root / "tiny")}


class ScriptedEngine:
    """Writes fixed turns as vLLM does: generation stops after the first stop string (its tokens
    kept, its text cut) or else after the EOS token (kept in the ids, not in the text)."""

    def __init__(self, tokenizer, family: str, turns: list[str]):
        self.tok, self.eos, self.turns = tokenizer, tokenizer.convert_tokens_to_ids(EOS.get(family, TINY_EOS)), list(turns)
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.logprobs: list[list[float]] = []

    async def agenerate(self, prompt_ids, params: SamplingParams) -> GenerationResult:
        await asyncio.sleep(0)
        text = self.turns[len(self.outputs)]
        hits = [(text.index(s) + len(s), s) for s in params.stop if s in text]
        if hits:
            cut, stop = min(hits)
            ids, shown = self.tok.encode(text[:cut], add_special_tokens=False), text[: cut - len(stop)]
        else:
            ids, shown = self.tok.encode(text, add_special_tokens=False) + [self.eos], text
        ids = ids[: params.max_new_tokens]
        logprobs = [-0.001 * (len(self.prompts) * 100 + j + 1) for j in range(len(ids))]  # distinct per token
        self.prompts.append(list(prompt_ids))
        self.outputs.append(ids)
        self.logprobs.append(logprobs)
        return GenerationResult(list(prompt_ids), ids, logprobs, "stop" if hits or ids[-1] == self.eos else "length", text=shown)


def run_agent(tokenizer, engine, agent, *, n: int = 1, **cfg):
    config = AgentEnvConfig(function="x:y", max_turns=cfg.pop("max_turns", 6), **cfg)
    runner = AgentRunner(engine, tokenizer, agent, config, max_total_tokens=4096, timeout_s=120)
    sample = Sample(prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], answer="100", index=5)
    results = runner([sample], SamplingParams(n=n, max_new_tokens=200))
    return runner, results


def model_blocks(result: GenerationResult) -> list[tuple[list[int], list[float]]]:
    """The runs of loss-mask-1 tokens of one segment, with their logprobs."""
    blocks, current = [], None
    for token, logprob, bit in zip(result.response_ids, result.response_logprobs, result.response_mask):
        if bit:
            if current is None:
                current = ([], [])
                blocks.append(current)
            current[0].append(token)
            current[1].append(logprob)
        else:
            assert logprob == 0.0
            current = None
    return blocks


def assert_segment_is_engines(segment: GenerationResult, engine: ScriptedEngine, requests: list[int]) -> None:
    """The segment's model tokens are the outputs of ``requests``, each fed exactly the segment up to it."""
    assert len(segment.response_mask) == len(segment.response_ids)
    assert model_blocks(segment) == [(engine.outputs[r], engine.logprobs[r]) for r in requests]
    full = segment.prompt_ids + segment.response_ids
    for r in requests:
        fed = engine.prompts[r]
        assert full[: len(fed)] == fed, f"request {r}'s prompt is not a prefix of its segment (re-tokenized history)"
        assert full[len(fed) : len(fed) + len(engine.outputs[r])] == engine.outputs[r]


@pytest.mark.parametrize("family", list(EOS))
def test_the_math_tool_agent_solves_the_task_token_exact(tokenizers, family):
    """The example agent (openai client, no rlcore import) with the calculator as OpenAI tools
    (Qwen2, Qwen3) or as <calc> text (Llama 3): it solves the task, and its one trajectory is the
    engine's three turns, token for token, with everything between them masked."""
    tok = tokenizers[family]
    turns = CALC_TURNS if family == "llama3" else LLAMA_TOOL_TURNS if family == "llama31" else TOOL_TURNS
    engine = ScriptedEngine(tok, family, turns)
    name = "calc_agent" if family == "llama3" else "agent"
    runner, results = run_agent(tok, engine, resolve_agent(f"{EXAMPLES / 'math_tool_agent.py'}:{name}"))
    (traj,) = runner.last_trajectories[0]
    assert traj.reward == 1.0 and traj.env_metrics["correct"] == 1.0 and traj.env_metrics["tool_calls"] == 2.0
    (result,) = results[0]
    assert result.segments is None and result.num_turns == 3
    assert_segment_is_engines(result, engine, [0, 1, 2])
    assert result.prompt_ids == engine.prompts[0]
    text = tok.decode(result.prompt_ids + result.response_ids)
    if family.startswith("qwen"):  # the tool results went back as role 'tool', templated by the chat template
        assert text.count("<tool_response>\n84\n</tool_response>") == 1 and "<tool_response>\n100\n</tool_response>" in text
    elif family == "llama31":  # Llama 3.1 shows them under the ipython role
        assert text.count('ipython<|end_header_id|>\n\n"84"<|eot_id|>') == 1 and '"100"<|eot_id|>' in text


def _strip_think(text: str) -> str:
    return re.sub(r"<think>.*?</think>\s*", "", text, flags=re.DOTALL)


async def rewriting_agent(client, sample):
    """Extends once, compacts its history (a new conversation), then re-sends its last reply without
    its <think> block (as Qwen3's template drops earlier reasoning) and extends that."""
    messages = list(sample.prompt)
    first = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message.content
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Go on."}]
    second = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message.content
    compacted = [messages[0], {"role": "user", "content": f"Summary so far: {_strip_think(first)} {_strip_think(second)} Answer now."}]
    third = (await client.chat.completions.create(model="policy", messages=compacted)).choices[0].message.content
    compacted += [{"role": "assistant", "content": _strip_think(third)}, {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="policy", messages=compacted)
    return 1.0


@pytest.mark.parametrize("family", list(EOS))
def test_rewritten_history_starts_segments_that_keep_the_engines_tokens(tokenizers, family):
    tok = tokenizers[family]
    think = family == "qwen3"
    turns = ["<think>\nFirst 12*7.\n</think>\n\n12*7 is 84." if think else "12*7 is 84.", "84+16 is 100.",
             "<think>\nThat is 100.\n</think>\n\nThe answer is \\boxed{100}." if think else "The answer is \\boxed{100}.",
             "Yes, \\boxed{100}."]
    engine = ScriptedEngine(tok, family, turns)
    runner, results = run_agent(tok, engine, rewriting_agent)
    (result,) = results[0]
    segments = (result.segments or []) + [result]
    # compaction, and for Qwen3 the dropped <think> too, start segments; the last request extends
    expected = [[0, 1], [2], [3]] if think else [[0, 1], [2, 3]]
    assert len(segments) == len(expected)
    for segment, requests in zip(segments, expected):
        assert_segment_is_engines(segment, engine, requests)
    compacted = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": f"Summary so far: {_strip_think(turns[0])} {_strip_think(turns[1])} Answer now."}]
    assert segments[1].prompt_ids == list(tok.apply_chat_template(compacted, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert runner.last_trajectories[0][0].env_metrics["agent_segments"] == len(expected)


def test_the_model_tokens_of_every_segment_train_with_the_trajectory_advantage(tokenizers):
    """Segments join the batch after the trajectories, each with its trajectory's advantage and reward."""
    import torch

    from rlcore.agents.segments import with_segments
    from rlcore.generation.batching import Trajectory, to_sequence_batch

    tok = tokenizers["qwen2"]
    engine = ScriptedEngine(tok, "qwen2", ["a is 1.", "b is 2.", "c is 3.", "d is 4."] * 2)
    runner, results = run_agent(tok, engine, rewriting_agent, n=2)
    trajs = [Trajectory(t.sample, 0, t.result, t.reward) for t in runner.last_trajectories[0]]
    advantages_N = torch.tensor([0.5, -0.5])
    keep_N = torch.tensor([True, False])
    batch = to_sequence_batch(trajs, advantages_N, 4096)
    batch.loss_mask[1] = torch.zeros_like(batch.loss_mask[1])
    batch = with_segments(batch, trajs, advantages_N, keep_N, 4096)
    assert len(batch) == 4  # two trajectories, then one earlier segment each
    assert batch.seq_fields["advantages"].tolist() == [0.5, -0.5, 0.5, -0.5]
    assert batch.loss_mask[3].sum() == 0 and batch.loss_mask[2].sum() == len(engine.outputs[0]) + len(engine.outputs[1])
    assert torch.equal(batch.token_fields["advantages"][2], torch.full_like(batch.token_fields["advantages"][2], 0.5))


def test_completions_extend_on_text_and_take_token_prompts_as_given(tokenizers):
    """/v1/completions: a prompt that starts with the segment's text so far appends only the rest;
    one that does not starts a segment; token-id prompts are taken as they are."""
    tok = tokenizers["llama3"]
    engine = ScriptedEngine(tok, "llama3", ["12*7 is 84", "so 100"])
    texts = {}

    async def agent(client, sample):
        first = await client.completions.create(model="policy", prompt="Question: 12*7+16?\nAnswer:", max_tokens=50)
        texts["first"] = first.choices[0].text
        prompt = "Question: 12*7+16?\nAnswer:" + first.choices[0].text + "\nThen add 16:"
        await client.completions.create(model="policy", prompt=prompt, max_tokens=50)
        return 1.0

    runner, results = run_agent(tok, engine, agent)
    (result,) = results[0]
    assert result.segments is None
    assert_segment_is_engines(result, engine, [0, 1])
    new = tok.encode("\nThen add 16:", add_special_tokens=False)
    assert engine.prompts[1] == engine.prompts[0] + engine.outputs[0] + new


def test_tool_calls_parse_from_both_template_formats():
    """Hermes blocks (Qwen2.5, Qwen3) and Llama 3.1's bare JSON turn become OpenAI ``tool_calls``;
    text that only looks like JSON stays content."""
    import json

    from rlcore.agents.recorder import parse_tool_calls

    content, calls = parse_tool_calls('Let me check.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n'
                                      '</tool_call>', "call-k")
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["calc"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "1+2"} and calls[0]["id"] == "call-k-0"
    content, calls = parse_tool_calls('{"name": "calc", "parameters": {"expression": "3*4"}}', "call-k")
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"expression": "3*4"}
    assert parse_tool_calls('{"answer": 12}', "call-k") == ('{"answer": 12}', [])
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", "call-k") == ("<tool_call>{not json}</tool_call>", [])


def test_segments_carry_their_trajectorys_reward_to_a_critic(tokenizers):
    """ppo: the critic's per-token targets start from each batch row's sequence reward; an earlier
    segment's is its trajectory's (Learner.batch_and_rewards)."""
    from rlcore.algorithms.config import PPOConfig
    from rlcore.controller.context import RunContext
    from rlcore.algorithms.ppo import PPO
    from rlcore.generation.batching import Trajectory
    from rlcore.controller.learner import Learner

    tok = tokenizers["qwen2"]
    engine = ScriptedEngine(tok, "qwen2", ["a is 1.", "b is 2.", "c is 3.", "d is 4."] * 2)
    runner, _ = run_agent(tok, engine, rewriting_agent, n=2)
    trajs = [Trajectory(t.sample, 0, t.result, reward) for t, reward in zip(runner.last_trajectories[0], (1.0, 0.25))]
    batch, rewards_N = Learner(None, PPO(PPOConfig()), RunContext(4096), 3).batch_and_rewards(trajs)
    assert len(batch) == 4 and rewards_N.tolist() == [1.0, 0.25, 1.0, 0.25]


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_tool_calls_are_parsed_and_rendered_back_token_exact(tokenizers, family):
    """The reply's ``tool_calls`` are parsed from the template's format, and the conversation the
    agent sends back (its assistant message as received, the ``tool`` results) is exactly the
    tokens the chat template renders for it: nothing trained differs from what the template shows."""
    from rlcore.agents.recorder import template_message

    tok = tokenizers[family]
    engine = ScriptedEngine(tok, family, {"llama31": LLAMA_TOOL_TURNS, "tiny": TINY_TOOL_TURNS}.get(family, TOOL_TURNS))
    tools = [{"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    seen: dict = {}

    async def agent(client, sample):
        messages = list(sample.prompt)
        for result in ("84", "100", None):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if result is None:
                break
            (call,) = message.tool_calls
            seen.setdefault("calls", []).append((reply.choices[0].finish_reason, call.function.name, json.loads(call.function.arguments)))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        seen["messages"] = messages
        return 1.0

    runner, results = run_agent(tok, engine, agent)
    (result,) = results[0]
    assert seen["calls"] == [("tool_calls", "calc", {"expression": "12*7"}), ("tool_calls", "calc", {"expression": "84+16"})]
    assert result.segments is None  # the conversation was extended, never re-rendered
    assert_segment_is_engines(result, engine, [0, 1, 2])
    # the last request's prompt (two tool calls and their results, recorded turn by turn) is the
    # template's rendering of the conversation the agent sent, token for token
    sent = [template_message(m) for m in seen["messages"][:-1]]
    rendered = tok.apply_chat_template(sent, tools=tools, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert engine.prompts[2] == rendered
    turns = result.turns
    assert [len(t.get("tool_calls", ())) for t in turns] == [1, 1, 0]
    assert [m["content"] for m in turns[1]["messages"] if m["role"] == "tool"] == ["84"]


def test_tools_on_a_template_without_tool_support_are_a_400_naming_it(tokenizers):
    import openai

    tok = tokenizers["llama3"]  # Llama 3.0's template renders no tools
    engine = ScriptedEngine(tok, "llama3", ["never"])
    errors = []

    async def agent(client, sample):
        try:
            await client.chat.completions.create(model="policy", messages=sample.prompt, tools=[{"type": "function", "function": {
                "name": "calc", "parameters": {"type": "object", "properties": {}}}}])
        except openai.BadRequestError as exc:
            errors.append(exc)
            raise

    with pytest.raises(RuntimeError, match="every one of the 1 agent groups"):  # a batch with no group left stops the run
        run_agent(tok, engine, agent, max_retries=0)
    (error,) = errors
    assert error.status_code == 400 and "'tools'" in error.message and tok.name_or_path in error.message
    assert "no tool support" in error.message and engine.prompts == []  # refused before generating
