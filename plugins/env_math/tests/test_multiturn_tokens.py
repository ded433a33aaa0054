"""A 3-turn ``math_tool`` rollout is token-exact: its tokens are the chat template of its messages.

Peers' multi-turn rollouts lose or duplicate the separator tokens between turns (verl#6501,
TRL#5224). Here the trajectory of a real rollout (``rlcore.generation.rollout`` built from a run config, the
``math_tool`` environment's calculator and grader) is compared, token for token, with the chat
template applied to the final message list, for byte-level BPE tokenizers with the released chat
templates of Llama 3, Qwen2 and Qwen3 (``rlcore.testing.chat_tokenizers``, saved and read back
with ``AutoTokenizer``). Only the model's text is scripted, returned as vLLM returns it: the ids
hold a stop string and the EOS token the model wrote, the text holds neither.
"""

from __future__ import annotations

import asyncio

import pytest

from rlcore import build_config
from rlcore.interfaces import GenerationResult, Sample, SamplingParams
from rlcore.plugins import get_plugin_manager
from rlcore.generation.rollout import ChatSuffixes, MultiTurnTrajectory, make_multi_turn_runner
from rlcore.testing.chat_tokenizers import build_chat_tokenizer

SYSTEM = "You are a helpful assistant."
QUESTION = "What is 12*7+16? Put your final answer within \\boxed{}."
PLAIN_TURNS = ["Let me compute 12*7 first. <calc>12*7</calc>", "Then add 16: <calc>84+16</calc>",
               "So the answer is \\boxed{100}."]
THINKING_TURNS = ["<think>\nFirst 12*7.\n</think>\n\n<calc>12*7</calc>", "<think>\nNow 84+16.\n</think>\n\n<calc>84+16</calc>",
                  "<think>\nThat is 100.\n</think>\n\nThe answer is \\boxed{100}."]
OBSERVATIONS = ["<result>84</result>", "<result>100</result>"]
# What the template writes after the model's end-of-turn token, which the model never writes.
AFTER_EOS = {"llama3": "", "qwen2": "\n", "qwen3": "\n"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {family: build_chat_tokenizer(family, root / family) for family in AFTER_EOS}


class ScriptedModel:
    """Writes fixed turns and answers as vLLM does: generation stops after the first stop string
    (its tokens kept, its text cut) or else after the EOS token (kept in the ids, not in the text)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tok, self.turns = tokenizer, turns
        self.prompts: list[list[int]] = []
        self.written: list[str] = []  # each turn's text as the model wrote it, stop string included
        self.ended_with_eos: list[bool] = []

    async def agenerate(self, prompt_ids, params: SamplingParams) -> GenerationResult:
        self.prompts.append(list(prompt_ids))
        await asyncio.sleep(0)
        text = self.turns[len(self.written)]
        hits = [(text.index(s) + len(s), s) for s in params.stop if s in text]
        if hits:
            cut, stop = min(hits)
            written, shown, ids = text[:cut], text[: cut - len(stop)], self.tok.encode(text[:cut], add_special_tokens=False)
        else:
            written, shown = text, text
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        self.written.append(written)
        self.ended_with_eos.append(not hits)
        return GenerationResult(prompt_ids=list(prompt_ids), response_ids=ids, response_logprobs=[-0.5] * len(ids),
                                finish_reason="stop", text=shown, policy_version=1)


def _rollout(tok, family: str, role: str, stop: tuple[str, ...], turns: list[str]) -> tuple[MultiTurnTrajectory, ScriptedModel]:
    config = build_config({
        "policy": {"model_name": "unused-no-model-is-loaded", "max_total_sequence_length": 1024},
        "env": {"name": "math_tool", "math_tool": {"executor": "inline", "max_turns": 3, "observation_role": role,
                                                   "turn_stop_strings": list(stop)}},
    })
    registration = get_plugin_manager().get("environment", "math_tool")
    env = registration.build(config.section("env.math_tool"))
    model = ScriptedModel(tok, turns)
    runner = make_multi_turn_runner(model, env, tok, config)
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    sample = Sample(prompt=prompt, answer="100", prompt_ids=_ids(tok, prompt, generation_prompt=True))
    try:
        traj = asyncio.run(runner.run_one(sample, SamplingParams(max_new_tokens=64)))
    finally:
        env.close()
    return traj, model


def _ids(tok, messages, generation_prompt: bool) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False))


def _messages(model: ScriptedModel, traj: MultiTurnTrajectory, role: str) -> list[dict[str, str]]:
    """The conversation as a chat client holds it: the prompt, then each model turn and observation."""
    messages = list(traj.sample.prompt)
    for k, written in enumerate(model.written):
        messages.append({"role": "assistant", "content": written})
        if k < len(traj.observations):
            messages.append({"role": role, "content": traj.observations[k]})
    return messages


CASES = [("llama3", "user", PLAIN_TURNS), ("llama3", "tool", PLAIN_TURNS), ("qwen2", "user", PLAIN_TURNS),
         ("qwen2", "tool", PLAIN_TURNS), ("qwen3", "tool", THINKING_TURNS)]


@pytest.mark.parametrize("stop", [(), ("</calc>",)], ids=["eos", "stop_string"])
@pytest.mark.parametrize(("family", "role", "turns"), CASES, ids=[f"{f}-{r}-{'think' if t is THINKING_TURNS else 'plain'}"
                                                                   for f, r, t in CASES])
def test_trajectory_is_the_chat_template_of_its_messages(tokenizers, family, role, turns, stop):
    tok = tokenizers[family]
    traj, model = _rollout(tok, family, role, stop, turns)
    assert traj.result.num_turns == 3 and traj.done and traj.reward == 1.0
    assert traj.observations == OBSERVATIONS  # the real calculator's answers
    assert model.ended_with_eos == [not stop, not stop, True]
    messages = _messages(model, traj, role)
    ids = traj.result.prompt_ids + traj.result.response_ids

    # without a generation prompt: the whole conversation, up to what follows the model's last EOS
    full = _ids(tok, messages, generation_prompt=False)
    assert tok.decode(full[len(ids):]) == AFTER_EOS[family] and full[: len(ids)] == ids, _diff(tok, full, ids)

    # with a generation prompt: each turn's prompt is the template of the conversation before it
    starts = []
    for k, prompt in enumerate(model.prompts):
        before = messages[: messages.index({"role": "assistant", "content": model.written[k]})]
        assert prompt == _ids(tok, before, generation_prompt=True), _diff(tok, _ids(tok, before, True), prompt)
        starts.append(len(prompt))

    # the loss mask covers exactly the model's tokens: each turn's text, and its EOS when it wrote one
    n_prompt = len(traj.result.prompt_ids)
    model_positions = set()
    for start, written, eos in zip(starts, model.written, model.ended_with_eos):
        n = len(tok.encode(written, add_special_tokens=False)) + eos
        model_positions |= set(range(start - n_prompt, start - n_prompt + n))
    mask = traj.result.response_mask
    assert {i for i, m in enumerate(mask) if m} == model_positions
    assert [lp for lp, m in zip(traj.result.response_logprobs, mask) if not m] == [0.0] * mask.count(0)
    assert set(lp for lp, m in zip(traj.result.response_logprobs, mask) if m) == {-0.5}


def test_qwen3_drops_earlier_reasoning_after_user_observations(tokenizers):
    """Qwen3's template renders only the reasoning of turns after the last user message. With
    observations in the ``user`` role the trajectory keeps the reasoning the model saw (so training
    matches sampling); the template's rendering differs from it by exactly those reasoning blocks."""
    tok = tokenizers["qwen3"]
    traj, model = _rollout(tok, "qwen3", "user", (), THINKING_TURNS)
    ids = traj.result.prompt_ids + traj.result.response_ids
    for earlier, later in zip(model.prompts, model.prompts[1:]):
        assert later[: len(earlier)] == earlier  # append-only: nothing the model saw is re-rendered
    text = tok.decode(ids)
    for turn in THINKING_TURNS[:2]:
        reasoning = turn[: turn.index("</think>\n\n") + len("</think>\n\n")]
        assert text.count(reasoning) == 1
        text = text.replace(reasoning, "")
    full = _ids(tok, _messages(model, traj, "user"), generation_prompt=False)
    assert full == tok.encode(text + AFTER_EOS["qwen3"], add_special_tokens=False), _diff(tok, full, ids)


def _diff(tok, want: list[int], got: list[int]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return (f"first difference at token {first}: template {tok.convert_ids_to_tokens(want[first : first + 6])} "
            f"vs trajectory {tok.convert_ids_to_tokens(got[first : first + 6])}; template text {tok.decode(want)!r}")


def test_end_of_turn_text_is_completed_only_after_a_special_token(tmp_path):
    tok = build_chat_tokenizer("qwen2", tmp_path / "newline_first")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    suffixes = ChatSuffixes(tok)
    newline, end = tok.encode("\n", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")
    assert suffixes.end_of_turn_ids == newline + [end]
    content = tok.encode("x", add_special_tokens=False)
    assert suffixes.closing_ids(content + newline) == newline + [end]  # the model's newline is content
    assert suffixes.closing_ids(content + newline + [end]) == []


def test_a_template_that_closes_turns_two_ways_is_refused_up_front(tmp_path):
    tok = build_chat_tokenizer("qwen2", tmp_path / "two_ways")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "{% if loop.last %}<|im_end|>{% else %}<|endoftext|>{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match=r"closes an assistant turn with '<\|im_end\|>'.*'<\|endoftext\|>.*before a 'tool'"):
        ChatSuffixes(tok, observation_role="tool")
