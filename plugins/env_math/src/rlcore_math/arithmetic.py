"""``arithmetic``: synthetic, seeded arithmetic problems ("12+7=") with a held-out split.

Difficulty is set by the operand ``digits``, the ``operations`` drawn from ``+ - *`` and the
``num_terms`` (3 or more make multi-step problems such as ``12+7*3=``; usual precedence), or by
a ``level`` preset (see :data:`rlcore_math.config.ARITHMETIC_LEVELS`). Answers are computed by
the ``math_tool`` calculator, and graded by the same grader as every math answer (the response's
final number). The validation problems are drawn first and are distinct; training problems are
drawn from the rest of the space (repeats allowed), so the two splits never share a problem.
Prompts use only characters of :func:`rlcore.testing.tiny.build_tokenizer`.
"""

from __future__ import annotations

import random
from typing import Any

from rlcore.interfaces import Sample
from rlcore.data.prompts import PromptSplits, messages_for

from rlcore_math.calculator import Calculator, format_number
from rlcore_math.config import ArithmeticDatasetConfig
from rlcore_math.prompts import DataError, tokenize_split


class ArithmeticGenerator:
    def __init__(self, digits: int, operations: tuple[str, ...], num_terms: int, allow_negative: bool):
        self.digits = digits
        self.operations = operations
        self.num_terms = num_terms
        self.allow_negative = allow_negative
        self._calc = Calculator(max_chars=1000, max_exponent=1, max_digits=100)

    def space_size(self) -> int:
        return (10**self.digits) ** self.num_terms * len(self.operations) ** (self.num_terms - 1)

    def draw(self, rng: random.Random) -> tuple[str, str]:
        """One (expression, answer) pair."""
        while True:
            terms = [str(rng.randrange(10**self.digits)) for _ in range(self.num_terms)]
            ops = [rng.choice(self.operations) for _ in range(self.num_terms - 1)]
            expr = terms[0] + "".join(op + t for op, t in zip(ops, terms[1:]))
            value = self._calc.evaluate(expr)
            if self.allow_negative or value >= 0:
                return expr, format_number(value)


def generate_splits(config: ArithmeticDatasetConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, validation) lists of (expression, answer); deterministic in ``config.seed``."""
    digits, operations, num_terms = config.resolved()
    gen = ArithmeticGenerator(digits, operations, num_terms, config.allow_negative)
    if gen.space_size() < 2 * config.num_validation:
        raise DataError(f"data: only {gen.space_size()} distinct problems with digits={digits}, operations={list(operations)}, "
                        f"num_terms={num_terms}: too few for num_validation={config.num_validation} held-out ones; "
                        "lower num_validation or raise the difficulty")
    rng = random.Random(f"rlcore-arithmetic-{config.seed}")
    validation: dict[str, str] = {}
    attempts = 0
    while len(validation) < config.num_validation:
        expr, answer = gen.draw(rng)
        validation.setdefault(expr, answer)
        attempts += 1
        if attempts > 50 * config.num_validation + 1000:
            raise DataError(f"data: could not draw {config.num_validation} distinct problems (allow_negative=false leaves too few?)")
    train = []
    while len(train) < config.num_train:
        expr, answer = gen.draw(rng)
        if expr not in validation:
            train.append((expr, answer))
    return train, list(validation.items())


def _samples(pairs: list[tuple[str, str]], config: ArithmeticDatasetConfig, split: str) -> list[Sample]:
    out = []
    for expr, answer in pairs:
        user = config.prompt_template.replace("{expr}", expr)
        out.append(Sample(prompt=messages_for(user, config.system_prompt), answer=answer,
                          metadata={"expr": expr, "split": split}))
    return out


def build_arithmetic_dataset(config: ArithmeticDatasetConfig, tokenizer: Any) -> PromptSplits:
    config = config or ArithmeticDatasetConfig()
    train_pairs, val_pairs = generate_splits(config)
    stats: dict[str, int] = {}
    train = tokenize_split(_samples(train_pairs, config, "train"), tokenizer, "train", None, stats, config.chat_template)
    validation = None
    if val_pairs:
        validation = tokenize_split(_samples(val_pairs, config, "validation"), tokenizer, "validation", None, stats,
                                    config.chat_template)
    return PromptSplits(train=train, validation=validation, stats=stats)
