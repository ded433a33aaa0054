"""A safe arithmetic evaluator for the ``math_tool`` environment's ``<calc>expr</calc>`` calls.

The expression is parsed with :mod:`ast` and walked by hand (never ``eval``): only numeric
literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses are accepted; names, calls,
attributes, subscripts, strings and everything else are refused. Arithmetic is exact
(:class:`fractions.Fraction`), and every value's size is checked *before* it is computed
(exponent bound, digit bound), so ``9**9**9`` is refused in microseconds instead of hanging.
Refusals are :class:`CalcError` with a message fit to show the model.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

_ALLOWED_HELP = "only numbers, + - * / // % ** and parentheses are allowed"


class CalcError(ValueError):
    """The expression is refused or cannot be evaluated; the message is shown to the model."""


_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: None,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    def __init__(self, max_chars: int = 200, max_exponent: int = 64, max_digits: int = 64, max_depth: int = 32):
        self.max_chars = max_chars
        self.max_exponent = max_exponent
        self.max_digits = max_digits
        self.max_depth = max_depth

    def evaluate(self, expression: str) -> Fraction:
        """The exact value of ``expression``; raises :class:`CalcError` when refused."""
        if not isinstance(expression, str):
            raise CalcError("expression must be text")
        text = expression.strip()
        if not text:
            raise CalcError("empty expression")
        if len(text) > self.max_chars:
            raise CalcError(f"expression too long ({len(text)} characters, at most {self.max_chars})")
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise CalcError(f"not a valid arithmetic expression; {_ALLOWED_HELP}") from None
        return self._eval(tree.body, 0)

    def __call__(self, expression: str) -> str:
        """The result as text for the model, or ``error: ...``: never raises."""
        try:
            return format_number(self.evaluate(expression))
        except CalcError as exc:
            return f"error: {exc}"
        except (ArithmeticError, RecursionError, MemoryError):
            return "error: the result cannot be computed"

    def _eval(self, node: ast.AST, depth: int) -> Fraction:
        if depth > self.max_depth:
            raise CalcError(f"expression nested too deeply (at most {self.max_depth} levels)")
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CalcError(f"{type(value).__name__} literals are not allowed; {_ALLOWED_HELP}")
            if isinstance(value, float) and not math.isfinite(value):
                raise CalcError("number too large")
            return self._bounded(Fraction(value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand, depth + 1))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left = self._eval(node.left, depth + 1)
            right = self._eval(node.right, depth + 1)
            return self._bounded(self._binary(node.op, left, right))
        raise CalcError(f"{_describe(node)} is not allowed; {_ALLOWED_HELP}")

    def _binary(self, op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
        if isinstance(op, ast.Pow):
            return self._power(left, right)
        if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        return Fraction(_BINARY[type(op)](left, right))

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise CalcError("only integer exponents are allowed")
        exp = int(exponent)
        if abs(exp) > self.max_exponent:
            raise CalcError(f"exponent {exp} too large (at most {self.max_exponent})")
        if base == 0 and exp < 0:
            raise CalcError("division by zero")
        if base and abs(exp) * math.log10(max(abs(base.numerator), base.denominator)) > self.max_digits:
            raise CalcError(f"result too large (more than {self.max_digits} digits)")
        return base**exp

    def _bounded(self, value: Fraction) -> Fraction:
        if _too_many_digits(value.numerator, self.max_digits) or _too_many_digits(value.denominator, self.max_digits):
            raise CalcError(f"result too large (more than {self.max_digits} digits)")
        return value


def _too_many_digits(n: int, limit: int) -> bool:
    bits = abs(n).bit_length()
    if bits * 0.30103 > limit + 1:  # surely too many; avoids str() of a huge int
        return True
    return len(str(abs(n))) > limit


def _describe(node: ast.AST) -> str:
    names = {ast.Name: "a name", ast.Call: "a function call", ast.Attribute: "attribute access",
             ast.Subscript: "indexing", ast.Lambda: "lambda", ast.Compare: "a comparison", ast.BoolOp: "and/or"}
    return names.get(type(node), f"'{type(node).__name__}'")


def format_number(value: Fraction) -> str:
    """Integers exactly; other values as decimals with up to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"
