"""The tool-call warm start of ``python -m rlcore.cli.demo --tools`` (:mod:`rlcore.cli.demo_tools`): its
conversations are trained on exactly the tokens the model writes through the agents' endpoint."""

from __future__ import annotations

import json

import pytest

from rlcore.agents.recorder import parse_tool_calls
from rlcore.cli.demo_tools import conversation_batch, tool_conversation
from rlcore.interfaces import Sample
from rlcore.generation.rollout import ChatSuffixes
from rlcore.testing.tiny import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(tools=True)


def _sample():
    return Sample(prompt=[{"role": "user", "content": "12+34="}], answer="46", metadata={"expr": "12+34"})


def test_a_tool_conversation_trains_the_call_and_the_answer_and_masks_the_rest(tokenizer):
    (ids,), (mask,) = (lambda b: (b.input_ids, b.loss_mask))(
        conversation_batch([tool_conversation(_sample(), TOOLS[0]["function"], use_tool=True)], tokenizer, TOOLS))
    ids, mask = ids.tolist(), mask.tolist()
    prompt = tokenizer.apply_chat_template(_sample().prompt, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids[: mask.index(1.0)]) == prompt == "[calc]<|user|>12+34=<|assistant|>"
    # the model's two turns, each ending with EOS; between them what the endpoint templates for the tool result
    runs, current = [], None
    for token, bit in zip(ids, mask):
        if bit and current is None:
            current = []
            runs.append(current)
        if bit:
            current.append(token)
        else:
            current = None
    call, answer = runs
    assert call[-1] == answer[-1] == tokenizer.eos_token_id
    content, calls = parse_tool_calls(tokenizer.decode(call[:-1]), "c")
    assert content == "" and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calc", {"expression": "12+34"})]
    assert tokenizer.decode(answer[:-1]) == "46"
    between = ids[mask.index(1.0) + len(call): len(ids) - len(answer)]
    tool_message = {"role": "tool", "tool_call_id": "call-0", "content": "46"}
    assert between == ChatSuffixes(tokenizer).messages_ids([tool_message], tools=TOOLS)


def test_a_direct_answer_is_trained_on_the_answer_alone(tokenizer):
    batch = conversation_batch([tool_conversation(_sample(), TOOLS[0]["function"], use_tool=False)], tokenizer, TOOLS)
    ids, mask = batch.input_ids[0].tolist(), batch.loss_mask[0].tolist()
    assert tokenizer.decode([t for t, bit in zip(ids, mask) if bit]) == "46</s>"
    assert sum(mask) == 3


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_conversation():
    class Rewriting:  # renders the last assistant turn differently once something follows it (as Qwen3's <think>)
        def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
            text = "".join(f"[{m['role']}:{m['content']}{'' if i == len(messages) - 1 else '!'}]" for i, m in enumerate(messages))
            return text + ("[assistant:" if add_generation_prompt else "")

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match="conversation 0 turn by turn"):
        conversation_batch([conversation], Rewriting())


def test_the_tools_tokenizer_writes_the_calls_json_in_a_few_pieces_and_keeps_every_plain_id(tokenizer, tmp_path):
    """A call is the expression plus 13 tokens (the tags, the JSON's pieces, EOS), as a byte-pair vocabulary
    splits it, not 53 characters; saved and loaded with ``AutoTokenizer`` it encodes the same, and every id
    of the plain demo tokenizer means what it did (the demo's SFT warm start reads the tools one)."""
    from transformers import AutoTokenizer

    (ids,), (mask,) = (lambda b: (b.input_ids, b.loss_mask))(
        conversation_batch([tool_conversation(_sample(), TOOLS[0]["function"])], tokenizer, TOOLS))
    start = mask.tolist().index(1.0)
    call = ids.tolist()[start: start + mask.tolist()[start:].index(0.0)]
    assert tokenizer.convert_ids_to_tokens(call) == [
        "<tool_call>", '{"', "name", '":"', "calc", '","', "arguments", '":{"', "expression", '":"',
        "1", "2", "+", "3", "4", '"}}', "</tool_call>", "</s>"]
    tokenizer.save_pretrained(tmp_path)
    text = tokenizer.decode(ids.tolist())
    assert AutoTokenizer.from_pretrained(tmp_path).encode(text, add_special_tokens=False) == ids.tolist()
    plain = build_tokenizer().get_vocab()
    assert {token: tokenizer.convert_tokens_to_ids(token) for token in plain} == plain
