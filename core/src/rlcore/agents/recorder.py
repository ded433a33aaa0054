"""Token in, token out: one trajectory's tokens as the engine produced them, request by request.

An agent talks to the endpoint in messages (chat) or text (completions); training needs the exact
token ids the model saw and wrote. A trajectory is recorded as a *segment*: prompt ids, then every
appended token with a loss-mask bit and its sampling logprob (0 where the model did not write it).

- **Extending** the recorded conversation (a request whose messages start with the messages
  recorded so far, the model's own replies as the endpoint returned them): the recorded tokens
  stand for the earlier turns, and only the new messages are templated, as the suffix the chat
  template renders for them after a closed assistant turn (:meth:`rlcore.generation.rollout.ChatSuffixes.messages_ids`),
  preceded by what completes the template's end-of-turn text after the model's last turn.
  Generated text is never re-tokenized.
- **Rewriting** (anything else: compaction, an edited or dropped turn, Qwen3's template dropping
  earlier ``<think>`` blocks when the agent re-renders): the current segment is closed as it is
  and a new one starts from the request's full rendering. Every segment keeps its own model
  tokens and trains with the trajectory's reward and advantage.

Completions (``/v1/completions``) follow the same rule on text: a prompt that starts with the
segment's text so far (prompt + completions as returned) appends only the tokens of the rest;
a prompt given as token ids is taken as it is.

Model tokens get loss mask 1 (their EOS included), everything else 0. Tool calls are parsed from
the generated text in the two formats the supported templates ask for: Hermes ``<tool_call>{json}
</tool_call>`` blocks (Qwen2.5, Qwen3) and a bare JSON ``{"name": .., "parameters": ..}`` turn
(Llama 3.1+).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import attrs

from rlcore.interfaces import GenerationResult
from rlcore.generation.rollout import ChatSuffixes

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP 400); the message names the trajectory."""


@attrs.define
class Segment:
    prompt_ids: list[int]
    ids: list[int] = attrs.field(factory=list)  # every token after the prompt
    logprobs: list[float] = attrs.field(factory=list)
    mask: list[int] = attrs.field(factory=list)
    messages: list[tuple] | None = None  # chat: the conversation as recorded (normalized)
    text: str | None = None  # completions: prompt text + every completion as returned
    last_response: list[int] = attrs.field(factory=list)  # the model's last turn (its end-of-turn is completed)
    finish_reason: str = "stop"
    version: int | None = None
    turns: list[dict] = attrs.field(factory=list)  # per request: the new messages and the reply (rollout traces)

    def total(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, model: bool) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.mask.extend([1 if model else 0] * len(ids))

    def result(self, text: str, num_turns: int) -> GenerationResult:
        return GenerationResult(prompt_ids=list(self.prompt_ids), response_ids=list(self.ids), response_logprobs=list(self.logprobs),
                                finish_reason=self.finish_reason, text=text, response_mask=list(self.mask),
                                policy_version=self.version or 0, num_turns=num_turns, turns=list(self.turns) or None)


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text is supported
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise RequestError(f"message content must be text or a list of text parts, got {type(content).__name__}")


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def normalize(message: dict) -> tuple:
    """What decides whether two messages are the same turn: role, text and tool calls (not ids)."""
    if not isinstance(message, dict) or "role" not in message:
        raise RequestError(f"each message must be an object with a 'role', got {str(message)[:80]!r}")
    calls = tuple((c.get("function", {}).get("name"), _canonical_arguments(c.get("function", {}).get("arguments")))
                  for c in message.get("tool_calls") or ())
    return (message["role"], _text_of(message.get("content")), calls)


def template_message(message: dict) -> dict:
    """A request message as chat templates expect it: text content, tool-call arguments as objects."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = _text_of(message.get("content"))
    if message.get("tool_calls"):
        calls = []
        for c in message["tool_calls"]:
            fn = dict(c.get("function", {}))
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append({**c, "function": fn})
        out["tool_calls"] = calls
    return out


def parse_tool_calls(text: str, call_prefix: str) -> tuple[str, list[dict]]:
    """(content without the calls, OpenAI ``tool_calls``) of a generated turn; no calls: (text, [])."""
    found = []
    for block in _HERMES.findall(text):
        try:
            found.append(json.loads(block))
        except json.JSONDecodeError:
            continue
    content = _HERMES.sub("", text).strip() if found else text
    if not found and text.strip().startswith("{"):
        try:
            whole = json.loads(text.strip())
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict) and "name" in whole and ("parameters" in whole or "arguments" in whole):
            found, content = [whole], ""
    calls = [{"id": f"{call_prefix}-{i}", "type": "function",
              "function": {"name": str(c.get("name", "")), "arguments": json.dumps(c.get("arguments", c.get("parameters", {})))}}
             for i, c in enumerate(found) if isinstance(c, dict)]
    return content, calls


def _turn(request: int, new_messages: list[dict] | None, reply: dict | None, out: GenerationResult,
          prompt_text: str | None) -> dict:
    """One request as traces show it: the messages it added (tool results among them), the reply and
    its tool calls, how many tokens the model wrote and with which weights."""
    turn: dict[str, Any] = {"request": request, "response_tokens": len(out.response_ids), "policy_version": out.policy_version,
                            "finish_reason": out.finish_reason}
    if new_messages is not None:
        turn["messages"] = [{k: (_text_of(v) if k == "content" else v) for k, v in m.items()
                             if k in ("role", "content", "tool_call_id", "name", "tool_calls")} for m in new_messages]
    elif prompt_text is not None:
        turn["prompt_chars"] = len(prompt_text)
    turn["reply"] = (reply or {}).get("content", out.text) if reply is not None else out.text
    if reply is not None and reply.get("tool_calls"):
        turn["tool_calls"] = reply["tool_calls"]
    return turn


_PROBE_TOOL = "rlcore_tool_probe"


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows the model the ``tools`` it is given (a template
    without tool support renders them to nothing, and the model would never see them)."""
    probe = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - no template, or one that cannot take tools
        return False
    return isinstance(text, str) and _PROBE_TOOL in text


def template_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


class TrajectoryRecorder:
    """The segments of one trajectory. Not thread-safe: the endpoint serves one request of a
    trajectory at a time."""

    def __init__(self, key: str, tokenizer, suffixes: ChatSuffixes | None):
        self.key, self.tokenizer, self.suffixes = key, tokenizer, suffixes
        self.segments: list[Segment] = []
        self.requests = 0
        self.last_text = ""

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def _close_turn(self, seg: Segment) -> list[int]:
        return self.suffixes.closing_ids(seg.last_response) if seg.last_response else []

    # ---- chat ---------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], template_kwargs: dict) -> tuple[Segment, list[int]]:
        """The segment this request continues (or starts) and the tokens to append to it before
        generating (mask 0). Nothing is appended yet: :meth:`commit_prompt` does, once it fits."""
        if not messages:
            raise RequestError(f"trajectory {self.key}: 'messages' is empty")
        normalized = [normalize(m) for m in messages]
        seg = self.current
        if seg is not None and seg.messages is not None and len(normalized) > len(seg.messages) \
                and normalized[: len(seg.messages)] == seg.messages:
            new = [template_message(m) for m in messages[len(seg.messages) :]]
            if self.suffixes is None:
                raise RequestError(f"trajectory {self.key}: the tokenizer has no chat template")
            return seg, self._close_turn(seg) + self.suffixes.messages_ids(new, **template_kwargs)
        try:
            ids = self.tokenizer.apply_chat_template([template_message(m) for m in messages], tokenize=True,
                                                     add_generation_prompt=True, **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template's own error, shown to the agent
            raise RequestError(f"trajectory {self.key}: the chat template cannot render these messages: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers may return a BatchEncoding
            ids = ids["input_ids"]
        fresh = Segment(prompt_ids=list(ids), messages=[])
        return fresh, []

    def completion_prompt(self, prompt: str | list[int]) -> tuple[Segment, list[int]]:
        seg = self.current
        if isinstance(prompt, list):
            if seg is not None and len(prompt) > seg.total() and prompt[: seg.total()] == seg.prompt_ids + seg.ids:
                return seg, list(prompt[seg.total() :])
            return Segment(prompt_ids=list(prompt)), []
        if seg is not None and seg.text is not None and len(prompt) > len(seg.text) and prompt.startswith(seg.text):
            return seg, list(self.tokenizer.encode(prompt[len(seg.text) :], add_special_tokens=False))
        return Segment(prompt_ids=list(self.tokenizer.encode(prompt)), text=""), []

    def commit_prompt(self, seg: Segment, new_ids: list[int]) -> None:
        if not self.segments or seg is not self.segments[-1]:
            self.segments.append(seg)
        seg.append(new_ids, None, model=False)

    def record(self, seg: Segment, out: GenerationResult, messages: list[dict] | None, reply: dict | None,
               prompt_text: str | None = None) -> None:
        """The model's turn: its tokens (mask 1, the engine's logprobs) and the conversation as the
        agent will send it back (``messages`` + ``reply`` for chat, the prompt text + completion otherwise)."""
        self.requests += 1
        seg.append(out.response_ids, out.response_logprobs, model=True)
        seg.last_response = list(out.response_ids)
        seg.finish_reason = out.finish_reason
        seg.version = out.policy_version if seg.version is None else min(seg.version, out.policy_version)
        self.last_text = out.text
        seg.turns.append(_turn(self.requests, messages[len(seg.messages or ()):] if messages is not None else None,
                               reply, out, prompt_text))
        if messages is not None:
            seg.messages = [normalize(m) for m in messages] + [normalize(reply or {"role": "assistant", "content": out.text})]
            seg.text = None
        elif isinstance(prompt_text, str):
            seg.text, seg.messages = prompt_text + out.text, None
        else:
            seg.text = seg.messages = None

    def result(self) -> GenerationResult | None:
        """The last segment as the trajectory's result, the earlier ones in ``segments``; None when the
        agent never reached the model."""
        kept = [s for s in self.segments if any(s.mask)]
        if not kept:
            return None
        main = kept[-1].result(self.last_text, self.requests)
        main.segments = [s.result("", self.requests) for s in kept[:-1]] or None
        return main
