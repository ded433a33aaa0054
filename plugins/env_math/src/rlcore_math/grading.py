"""Grade one response against one ground truth with math-verify, within a time limit.

:func:`grade` is pure and never raises on model output: every failure is a :class:`Verdict` with
``correct=False`` and a ``status`` the environment counts in its metrics.

Time limits. math-verify's own ``parsing_timeout``/``timeout_seconds`` use ``signal.alarm``:
whole seconds only, main thread only, and a timeout is swallowed (indistinguishable from "no
answer"). So both are disabled here, and :func:`grade` arms its own ``setitimer`` deadline (float
seconds) that raises :class:`GradeTimeout`, a ``BaseException`` that math-verify's ``except
Exception`` blocks cannot swallow. Signals only work in a main thread and only between Python
bytecodes, so graders run in worker processes (:mod:`rlcore_math.pool`) whose parent also kills
a worker that overruns the deadline inside C code. Cheap pre-checks (:func:`precheck`) reject
huge or absurdly nested input before any regex or sympy work.
"""

from __future__ import annotations

import functools
import re
import signal
import threading
import time
from typing import NamedTuple

STATUSES = ("ok", "parse_error", "timeout", "rejected", "gold_error", "format_error", "error")


class Verdict(NamedTuple):
    correct: bool
    format_ok: bool
    status: str  # one of STATUSES


class GradeTimeout(BaseException):
    """The verification deadline passed (BaseException: library ``except Exception`` lets it through)."""


@functools.lru_cache(maxsize=1)
def _math_verify():
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # We pass timeouts of None on purpose (see module docstring); silence the one-time warning.
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    pred_config = [math_verify.LatexExtractionConfig(boxed_match_priority=0), math_verify.ExprExtractionConfig()]
    return math_verify, pred_config


_HASH_RE = re.compile(r"####\s*\$?\s*([-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+)")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)
_OPENERS = "{(["
_CLOSERS = "})]"


def precheck(response: object, max_chars: int, window: int, max_depth: int) -> tuple[str | None, str]:
    """Cheap checks before any parsing: ``(text_to_grade, "ok")`` or ``(None, status)``.

    ``text_to_grade`` is the last ``window`` characters (answers come last; regexes and sympy
    then see bounded input whatever the response length).
    """
    if not isinstance(response, str):
        return None, "error"
    if len(response) > max_chars:
        return None, "rejected"
    text = response[-window:]
    if sum(text.count(c) for c in _OPENERS) > max_depth and _max_depth(text) > max_depth:
        return None, "rejected"
    return text, "ok"


_NOT_BRACKET_RE = re.compile(r"[^{}()\[\]]+")


def _max_depth(text: str) -> int:
    """Deepest bracket nesting, any kind closing any kind (so intervals like [0, 1) balance)."""
    depth = deepest = 0
    for ch in _NOT_BRACKET_RE.sub("", text):  # the loop then sees brackets only
        if ch in _OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in _CLOSERS and depth:
            depth -= 1
    return deepest


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if none."""
    for marker in ("\\boxed", "\\fbox"):
        start, tries = text.rfind(marker + "{"), 0
        while start != -1 and tries < 4:  # bounded: each unclosed try scans to the end
            tries += 1
            i, depth = start + len(marker), 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
            start = text.rfind(marker + "{", 0, start)  # unclosed: try an earlier one
    return None


def hash_answer(text: str) -> str | None:
    """The number after the last ``#### `` (GSM8K style), commas removed; None if none."""
    matches = _HASH_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def answer_formats(text: str) -> dict[str, bool]:
    return {
        "boxed": last_boxed(text) is not None,
        "hash": hash_answer(text) is not None,
        "answer_is": _ANSWER_IS_RE.search(text) is not None,
    }


def format_ok(text: str, required: str) -> bool:
    if required == "none":
        return True
    found = answer_formats(text)
    return any(found.values()) if required == "any" else found[required]


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str):
    mv, _ = _math_verify()
    parsed = mv.parse("\\boxed{" + gold + "}", parsing_timeout=None)
    if not parsed:  # plain text gold such as "x = 3 or x = 5": let math-verify find it
        parsed = mv.parse(gold, parsing_timeout=None)
    return parsed


def _verify(text: str, gold: str, float_rounding: int) -> tuple[bool, str]:
    mv, pred_config = _math_verify()
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return False, "gold_error"
    # The last \boxed{} is the final answer (math-verify would merge several into a set), and
    # '#### n' is GSM8K's final-answer marker, not just one more number.
    boxed = last_boxed(text)
    if boxed is not None:
        text = "\\boxed{" + boxed + "}"
    elif (hashed := hash_answer(text)) is not None:
        text = "\\boxed{" + hashed + "}"
    pred = mv.parse(text, pred_config, parsing_timeout=None)
    if not pred:
        return False, "parse_error"
    return bool(mv.verify(gold_parsed, pred, float_rounding=float_rounding, timeout_seconds=None)), "ok"


def _raise_timeout(signum, frame):
    raise GradeTimeout()


def call_with_deadline(fn, seconds: float | None):
    """Run ``fn()`` with a SIGALRM deadline (main thread only; elsewhere without one).

    An interval timer someone else had armed (pytest-timeout, say) is re-armed afterwards with
    its remaining time, so it still fires (at most ``seconds`` late).
    """
    if not seconds or threading.current_thread() is not threading.main_thread():
        return fn()
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay:
            remaining = max(outer_delay - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)


def grade_text(text: str, gold: object, *, timeout_s: float | None, float_rounding: int = 6,
               answer_format: str = "any", strict_format: bool = False) -> Verdict:
    """Grade a pre-checked ``text`` (see :func:`precheck`). Never raises on model output."""
    def run() -> Verdict:
        fmt = format_ok(text, answer_format)
        if strict_format and not fmt:
            return Verdict(False, False, "format_error")
        gold_text = str(gold).strip() if gold is not None else ""
        if not gold_text:
            return Verdict(False, fmt, "gold_error")
        correct, status = _verify(text, gold_text, float_rounding)
        return Verdict(correct, fmt, status)

    try:
        return call_with_deadline(run, timeout_s)
    except GradeTimeout:
        return Verdict(False, False, "timeout")
    except Exception:  # noqa: BLE001 - model output must never crash the run; counted as env/error
        return Verdict(False, False, "error")


def grade(response: object, gold: object, options) -> Verdict:
    """Pre-check and grade one response; ``options`` is a :class:`~rlcore_math.config.GradingConfig`."""
    text, status = precheck(response, options.max_response_chars, options.answer_window_chars, options.max_nesting_depth)
    if text is None:
        return Verdict(False, False, status)
    return grade_text(text, gold, timeout_s=options.timeout_s, float_rounding=options.float_rounding,
                      answer_format=options.answer_format, strict_format=options.strict_format)


def reward_of(verdict: Verdict, options) -> float:
    return options.correct_reward * verdict.correct + options.format_reward * verdict.format_ok


def verdict_metrics(verdict: Verdict) -> dict[str, float]:
    """Per-trajectory metrics: ``env/correct``, ``env/format_ok`` and one flag per failure status."""
    metrics = {"env/correct": float(verdict.correct), "env/format_ok": float(verdict.format_ok)}
    for status in STATUSES[1:]:
        metrics[f"env/{status}"] = float(verdict.status == status)
    return metrics
