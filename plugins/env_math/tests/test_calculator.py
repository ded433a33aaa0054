"""The math_tool calculator: exact arithmetic, and a clear refusal (never an exception) for anything else."""

from __future__ import annotations

import time

import pytest

from rlcore_math.calculator import CalcError, Calculator

CALC = Calculator(max_chars=200, max_exponent=64, max_digits=64)


@pytest.mark.parametrize("expression,expected", [
    ("12+7", "19"), ("2**10", "1024"), ("(3+4)*5", "35"), ("-5 % 3", "1"), ("10 // 3", "3"), ("7/2", "3.5"),
    ("1/3", "0.333333333333"), ("0.1+0.2", "0.3"), ("2**-3", "0.125"), ("-(-(4))", "4"), ("1_000 * 3", "3000"),
    ("9**9", "387420489"), ("(" * 40 + "1" + ")" * 40, "1"), (" 6 * 7 ", "42"), ("2**64", "18446744073709551616"),
])
def test_arithmetic(expression, expected):
    assert CALC(expression) == expected


@pytest.mark.parametrize("expression,reason", [
    ("__import__('os').system('echo hi')", "function call"),
    ("__import__", "name"),
    ("(1).real", "attribute access"),
    ("().__class__.__bases__[0].__subclasses__()", "not allowed"),
    ("9**9**9", "exponent 387420489 too large"),
    ("10**64 * 10**64", "too large"),
    ("1" * 10_000, "too long"),
    ("+".join(["1"] * 5000), "too long"),
    ("'a' * 3", "str literals"),
    ("True + 1", "bool literals"),
    ("lambda: 1", "lambda"),
    ("[1, 2][0]", "not allowed"),
    ("1 < 2", "comparison"),
    ("x + 1", "name"),
    ("1j * 2", "complex literals"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "integer exponents"),
    ("1e400", "too large"),
    ("((1+2)", "not a valid arithmetic expression"),
    ("", "empty"),
    ("-" * 40 + "1", "nested too deeply"),
    ("+".join(["1"] * 60), "nested too deeply"),
    ("import os", "not a valid arithmetic expression"),
])
@pytest.mark.wall_clock
def test_refusals_are_clear_observations(expression, reason):
    started = time.monotonic()
    answer = CALC(expression)  # never raises
    assert time.monotonic() - started < 0.5
    assert answer.startswith("error: ") and reason in answer, answer
    with pytest.raises(CalcError):
        CALC.evaluate(expression)


def test_non_text_input():
    assert CALC(None).startswith("error: ")  # type: ignore[arg-type]


def test_limits_are_configurable():
    small = Calculator(max_chars=5, max_exponent=2, max_digits=3)
    assert small("2**3").startswith("error: exponent 3 too large")
    assert small("999+1").startswith("error: result too large")
    assert small("123456").startswith("error: expression too long")
    assert small("99*9") == "891"
