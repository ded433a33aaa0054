"""``python -m rlcore.cli.demo --tools``: the CPU demo's policy trained, as an agent, to call a calculator tool.

The agent is ``examples/agents/math_tool_agent.py:agent`` (the ``openai`` client alone): it sends
the problem with ``tools=[calc]``, runs every returned tool call, sends the result back as a
``tool`` message and is graded on its final answer. GRPO trains it through rlcore's endpoint
(``recipes/grpo_agent_tool_arith_tiny_cpu.yaml``).

The model is the demo's SFT warm start (2-digit addition, answered directly) given the tiny
tokenizer's tools-aware chat template (:data:`rlcore.testing.tiny.TOOL_CHAT_TEMPLATE`: OpenAI
``tools`` rendered, Qwen-style ``<tool_call>`` blocks parsed by the endpoint), then an SFT on
conversations from the training split, every one calling the tool with the problem's expression
and answering with its result; only the model's turns are trained. It stops once the held-out
calls copy the expression right for a target share of the problems (:func:`tool_call_accuracy`,
greedy, through the endpoint's own parser), as the demo's warm start stops at a target accuracy:
GRPO, rewarding the right final answer alone, learns the rest (the agents guide gives the measured run).
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Any, Sequence

TOOL_RECIPE = (Path(__file__).resolve().parents[1] / "recipes" / "grpo_agent_tool_arith_tiny_cpu.yaml").resolve()


def conversation_batch(conversations: Sequence[list[dict]], tokenizer: Any, tools: list[dict] | None = None):
    """Each conversation's ids as the chat template renders it (with ``tools``), trained on the
    assistant turns only (their end of turn included): the tokens the model writes at rollout,
    the rest (prompt, tool results, generation prompts) masked."""
    import torch

    from rlcore.interfaces import SequenceBatch

    ids, masks = [], []
    for messages in conversations:
        seq, mask, done = [], [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = _render(tokenizer, messages[:i], tools, generation_prompt=True)
            after = _render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
            if not (before.startswith(done) and after.startswith(before)):
                raise ValueError(f"the chat template does not render conversation {len(ids)} turn by turn "
                                 f"(message {i} changes what came before it): it cannot be trained turn by turn")
            for text, trained in ((before[len(done):], 0.0), (after[len(before):], 1.0)):
                piece = tokenizer.encode(text, add_special_tokens=False) if text else []
                seq += piece
                mask += [trained] * len(piece)
            done = after
        ids.append(torch.tensor(seq))
        masks.append(torch.tensor(mask))
    return SequenceBatch(input_ids=ids, loss_mask=masks)


def _render(tokenizer, messages, tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def tool_conversation(sample, tool: dict, use_tool: bool = True) -> list[dict]:
    """A training problem solved with one call of ``tool`` (its first required argument the problem's
    expression) whose result is the final answer; without ``use_tool``, answered directly."""
    if not use_tool:
        return [*sample.prompt, {"role": "assistant", "content": str(sample.answer)}]
    argument = tool["parameters"]["required"][0]
    call = {"id": "call-0", "type": "function",
            "function": {"name": tool["name"], "arguments": {argument: sample.metadata["expr"]}}}
    return [*sample.prompt, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call-0", "content": str(sample.answer)},
            {"role": "assistant", "content": str(sample.answer)}]


def tool_call_accuracy(generator, tokenizer, tools: list[dict], samples: Sequence, max_new_tokens: int) -> dict:
    """Greedy, on ``samples`` (held-out), read by the endpoint's own parser: ``calls``, the share of first
    replies that call the first tool (the others answer directly); ``arguments``, of calls, once begun
    (the prompt ends with ``<tool_call>``), that copy the problem's expression exactly, so the calculator
    returns the answer; ``answers``, of final replies that give the answer, shown the right tool result."""
    from rlcore.agents.recorder import parse_tool_calls
    from rlcore.interfaces import SamplingParams

    tool = tools[0]["function"]
    argument = tool["parameters"]["required"][0]
    begin = tokenizer.convert_tokens_to_ids("<tool_call>")
    conversations = [tool_conversation(s, tool) for s in samples]
    first = [_prompt_ids(tokenizer, c[:-3], tools) for c in conversations]
    last = [_prompt_ids(tokenizer, c[:-1], tools) for c in conversations]
    prompts = first + [ids + [begin] for ids in first] + last
    results = generator.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    texts = [tokenizer.decode(r[0].response_ids, skip_special_tokens=True) for r in results]
    n = len(samples)
    calls = arguments = answers = 0
    for i, sample in enumerate(samples):
        calls += _called(parse_tool_calls(texts[i], "eval")[1], tool["name"]) is not None
        begun = _called(parse_tool_calls("<tool_call>" + texts[n + i], "eval")[1], tool["name"])
        arguments += begun is not None and begun.get(argument) == sample.metadata["expr"]
        answers += texts[2 * n + i].strip() == str(sample.answer)
    return {"calls": calls / max(1, n), "arguments": arguments / max(1, n), "answers": answers / max(1, n)}


def _called(calls: list[dict], name: str) -> dict | None:
    """The arguments of the first call in ``calls`` when it calls ``name`` (None otherwise)."""
    if not calls or calls[0]["function"]["name"] != name:
        return None
    try:
        arguments = json.loads(calls[0]["function"]["arguments"])
    except json.JSONDecodeError:
        return None
    return arguments if isinstance(arguments, dict) else None


def _prompt_ids(tokenizer, messages: list[dict], tools: list[dict]) -> list[int]:
    return tokenizer.encode(_render(tokenizer, messages, tools, generation_prompt=True), add_special_tokens=False)


def agent_tools(recipe) -> list[dict]:
    """The ``TOOLS`` of the module that defines the recipe's agent (``env.agent.function``)."""
    from rlcore.agents.runner import resolve_agent

    module = inspect.getmodule(resolve_agent(recipe.section("env.agent").function))
    tools = getattr(module, "TOOLS", None)
    if not tools:
        raise SystemExit(f"env.agent.function: the module of {recipe.section('env.agent').function!r} has no TOOLS "
                         "list (OpenAI tools format) to train the warm start's calls on")
    return tools


def tool_warm_start(sft_dir: Path, out_dir: Path, recipe, config, target: float, max_steps: int, batch_size: int,
                    tool_every: int = 1, eval_every: int = 25) -> dict:
    """The demo's SFT warm start (``sft_dir``) with the tools-aware tiny tokenizer, trained on tool-call
    conversations of the recipe's training split until the held-out calls' arguments are right for
    ``target`` of the problems (:func:`tool_call_accuracy`, every ``eval_every`` steps; at most
    ``max_steps``), exported to ``out_dir`` with its history; ``config`` is the SFT run's
    (``rlcore.cli.demo.sft_config`` of the recipe, from ``sft_dir``)."""
    from rlcore.config.hf_generation import HFGenerationConfig
    from rlcore.controller.transport import StreamTransport
    from rlcore.controller.heartbeat import heartbeat
    from rlcore.controller.workers import LocalTrainer
    from rlcore.generation.hf_generator import HFGenerator
    from rlcore.interfaces import Placement
    from rlcore.plugins import get_plugin_manager
    from rlcore.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer(tools=True)
    tools = agent_tools(recipe)
    manager = get_plugin_manager()
    dataset = manager.get("dataset", config.section("data").name).build(config.section("data"), tokenizer)
    algorithm = manager.get("algorithm", "sft").build(config.section("algorithm"))
    reg = manager.get("training_backend", "fsdp2")
    device = "cuda" if config.cluster.gpus_per_node else "cpu"
    trainer = LocalTrainer.build(reg, config, config.section(reg.section), Placement(device=device))
    evaluator = HFGenerator(str(sft_dir), HFGenerationConfig(), config.policy.max_total_sequence_length, device=device)

    def evaluate() -> dict:
        StreamTransport().transfer(trainer, evaluator)
        return tool_call_accuracy(evaluator, tokenizer, tools, list(dataset.validation), recipe.generation.max_new_tokens)

    with heartbeat():
        history = _train_tool_calls(trainer, algorithm, dataset.train, tokenizer, tools, evaluate, target, max_steps,
                                    batch_size, tool_every, eval_every)
    trainer.backend.export_hf(str(out_dir))
    tokenizer.save_pretrained(out_dir)
    trainer.shutdown()
    (out_dir / "tool_warm_start.json").write_text(json.dumps({"target": target, "tool_every": tool_every, "history": history}, indent=2))
    return history[-1] if history else {}


def _train_tool_calls(trainer, algorithm, train, tokenizer, tools, evaluate, target, max_steps, batch_size,
                      tool_every, eval_every) -> list[dict]:
    from rlcore.controller.heartbeat import doing, said

    history, started = [], time.perf_counter()
    for step in range(1, max_steps + 1):
        doing(f"tool-call warm start, step {step}")
        first = (step - 1) * batch_size
        indices = [(first + i) % len(train) for i in range(batch_size)]
        conversations = [tool_conversation(train[i], tools[0]["function"], i % tool_every == 0) for i in indices]
        metrics = trainer.train(conversation_batch(conversations, tokenizer, tools), algorithm)
        if step % eval_every == 0 or step == max_steps:
            accuracy = evaluate()
            history.append({"step": step, "loss": float(metrics.get("loss", float("nan"))), **accuracy,
                            "seconds": time.perf_counter() - started})
            print(f"tool warm start step {step:4d}  loss {history[-1]['loss']:.4f}  held-out greedy: calls {accuracy['calls']:.3f}"
                  f"  right arguments {accuracy['arguments']:.3f}  answers from the result {accuracy['answers']:.3f}"
                  f"  ({history[-1]['seconds']:.0f}s)", flush=True)
            said()
            if accuracy["arguments"] >= target:
                break
    return history
