"""``code_tasks``: seeded, generated Python tasks ("write a function that ..."), each with hidden tests.

A task is a small parametrized function (``f(x)`` returning ``x * 3 + 2``, the number of ``'a'`` in
a string, ...): the prompt describes it, ``Sample.answer`` holds the hidden tests (inputs and the
outputs the reference computes), never shown to the model. Train and validation tasks are drawn
from one seeded stream and never share a description. Prompts use only characters of
:func:`rlcore.testing.tiny.build_tokenizer` (no backticks), so the tiny CPU models can read them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs

from rlcore.interfaces import Sample
from rlcore.data.prompts import PromptSplits, messages_for
from rlcore_envs.common import build_splits
from rlcore_envs.config import CodeTasksDatasetConfig

_LETTERS = "abcdefgh"


@attrs.frozen
class CodeTask:
    family: str
    signature: str
    description: str
    reference: Callable[..., Any]
    inputs: Callable[[random.Random], list]  # one test's arguments


def _arith(rng: random.Random) -> CodeTask:
    a, b = rng.randint(2, 9), rng.randint(0, 9)
    kind = rng.choice(["affine", "square_plus", "mod"])
    if kind == "affine":
        return CodeTask("arith", "f(x)", f"returns x * {a} + {b}", lambda x: x * a + b, lambda r: [r.randint(-50, 50)])
    if kind == "square_plus":
        return CodeTask("arith", "f(x)", f"returns x * x + {b}", lambda x: x * x + b, lambda r: [r.randint(-20, 20)])
    return CodeTask("arith", "f(x)", f"returns the remainder of x divided by {a}", lambda x: x % a, lambda r: [r.randint(0, 99)])


def _word(r: random.Random) -> str:
    return "".join(r.choice(_LETTERS) for _ in range(r.randint(0, 8)))


def _strings(rng: random.Random) -> CodeTask:
    k = rng.randint(2, 4)
    kind = rng.choice(["repeat", "reverse", "upper"])
    if kind == "repeat":
        return CodeTask("strings", "f(s)", f"returns the string s repeated {k} times", lambda s: s * k, lambda r: [_word(r)])
    if kind == "reverse":
        return CodeTask("strings", "f(s)", "returns the string s reversed", lambda s: s[::-1], lambda r: [_word(r)])
    return CodeTask("strings", "f(s)", "returns the string s in upper case", lambda s: s.upper(), lambda r: [_word(r)])


def _numbers(r: random.Random) -> list[int]:
    return [r.randint(-9, 9) for _ in range(r.randint(0, 6))]


def _lists(rng: random.Random) -> CodeTask:
    t = rng.randint(-3, 3)
    kind = rng.choice(["sum_above", "max_or_zero", "doubled"])
    if kind == "sum_above":
        return CodeTask("lists", "f(xs)", f"returns the sum of the numbers in the list xs that are greater than {t}",
                        lambda xs: sum(x for x in xs if x > t), lambda r: [_numbers(r)])
    if kind == "max_or_zero":
        return CodeTask("lists", "f(xs)", "returns the largest number in the list xs, or 0 if xs is empty",
                        lambda xs: max(xs) if xs else 0, lambda r: [_numbers(r)])
    return CodeTask("lists", "f(xs)", "returns a new list with every number of the list xs doubled",
                    lambda xs: [2 * x for x in xs], lambda r: [_numbers(r)])


def _counting(rng: random.Random) -> CodeTask:
    c = rng.choice(_LETTERS)
    kind = rng.choice(["count", "index"])
    if kind == "count":
        return CodeTask("counting", "f(s)", f"returns how many times the letter {c} occurs in the string s",
                        lambda s: s.count(c), lambda r: [_word(r)])
    return CodeTask("counting", "f(s)", f"returns the position of the first {c} in the string s, or -1 if there is none",
                    lambda s: s.find(c), lambda r: [_word(r)])


FAMILIES: dict[str, Callable[[random.Random], CodeTask]] = {
    "arith": _arith, "strings": _strings, "lists": _lists, "counting": _counting,
}


def make_sample(task: CodeTask, rng: random.Random, config: CodeTasksDatasetConfig, split: str) -> Sample:
    inputs = [task.inputs(rng) for _ in range(config.tests_per_task)]
    answer = {"entry_point": "f", "inputs": inputs, "outputs": [task.reference(*args) for args in inputs]}
    user = config.prompt_template.replace("{signature}", task.signature).replace("{description}", task.description)
    return Sample(prompt=messages_for(user, config.system_prompt), answer=answer,
                  metadata={"task": task.family, "description": task.description, "split": split})


def generate(config: CodeTasksDatasetConfig) -> tuple[list[Sample], list[Sample]]:
    """(train, validation) samples, deterministic in ``config.seed``; no description is in both."""
    rng = random.Random(f"rlcore-code-tasks-{config.seed}")
    families = [FAMILIES[name] for name in config.families]
    validation, held_out = [], set()
    for _ in range(config.num_validation):
        task = rng.choice(families)(rng)
        held_out.add(task.description)
        validation.append(make_sample(task, rng, config, "validation"))
    train = []
    for _ in range(50 * config.num_train + 1000):
        if len(train) == config.num_train:
            break
        task = rng.choice(families)(rng)
        if task.description not in held_out:
            train.append(make_sample(task, rng, config, "train"))
    if len(train) < config.num_train:
        raise ValueError(f"data: the held-out tasks cover every task of families {list(config.families)}; "
                         "lower data.num_validation or add families")
    return train, validation


def build_dataset(config: CodeTasksDatasetConfig, tokenizer: Any) -> PromptSplits:
    config = config or CodeTasksDatasetConfig()
    train, validation = generate(config)
    return build_splits(train, validation, tokenizer, config)
