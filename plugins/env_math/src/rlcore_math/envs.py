"""The ``math`` and ``math_tool`` environments.

Both are pure: model output never raises; a response that cannot be graded scores 0 and its
reason is counted in ``EnvStep.metrics`` (``env/parse_error``, ``env/timeout``, ``env/rejected``,
...). Grading metrics (``env/correct``, ``env/format_ok`` and the failure flags) are set on the
step that ends a trajectory; ``math_tool`` adds ``env/tool_calls``, ``env/tool_errors`` on every
step and ``env/turns``, ``env/turn_limit`` on the last.
"""

from __future__ import annotations

import re

from rlcore.interfaces import EnvStep, Sample

from rlcore_math.calculator import Calculator
from rlcore_math.config import MathEnvConfig, MathToolEnvConfig
from rlcore_math.grading import reward_of, verdict_metrics
from rlcore_math.pool import make_grader

# A turn that stopped on the "</calc>" stop string ends with an unclosed call: accept it too.
CALC_RE = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)


def _last_turn(history: object) -> object:
    if isinstance(history, (list, tuple)) and history:
        return history[-1]
    return ""


class MathEnvironment:
    """Single turn: the model's answer is graded against ``Sample.answer`` (reward 1/0 + format)."""

    def __init__(self, config: MathEnvConfig | None = None):
        self.config = config or MathEnvConfig()
        self.grader = make_grader(self.config)

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        _check_lengths(samples, histories)
        responses = [_last_turn(h) for h in histories]
        return self._final_steps(samples, responses, [{} for _ in samples])

    def _final_steps(self, samples: list[Sample], responses: list[object], extra: list[dict]) -> list[EnvStep]:
        verdicts = self.grader.grade(responses, [s.answer for s in samples])
        return [
            EnvStep(reward=reward_of(v, self.config), done=True, metrics={**verdict_metrics(v), **more})
            for v, more in zip(verdicts, extra)
        ]

    def close(self) -> None:
        self.grader.close()


class MathToolEnvironment(MathEnvironment):
    """Multi-turn: ``<calc>expr</calc>`` turns get ``<result>value</result>`` back, the last turn is graded.

    A turn with calculator calls (and turns left) continues the trajectory; a turn without one is
    the answer. At ``max_turns`` the trajectory ends and the last turn is graded whatever it holds.
    Calculator blocks are removed before grading, so a bare ``<calc>`` turn is not an answer.
    """

    config: MathToolEnvConfig

    def __init__(self, config: MathToolEnvConfig | None = None):
        super().__init__(config or MathToolEnvConfig())
        c = self.config
        self.calculator = Calculator(max_chars=c.max_expression_chars, max_exponent=c.max_exponent, max_digits=c.max_result_digits)

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        _check_lengths(samples, histories)
        steps: list[EnvStep | None] = [None] * len(samples)
        final: list[int] = []
        final_texts: list[object] = []
        extra: list[dict] = []
        for i, history in enumerate(histories):
            turn = _last_turn(history)
            num_turns = len(history) if isinstance(history, (list, tuple)) else 1
            calls = CALC_RE.findall(turn) if isinstance(turn, str) else []
            if calls and num_turns < self.config.max_turns:
                steps[i] = self._tool_step(calls)
                continue
            final.append(i)
            final_texts.append(CALC_RE.sub("", turn) if isinstance(turn, str) else turn)
            extra.append({"env/tool_calls": 0.0, "env/tool_errors": 0.0, "env/turns": float(num_turns),
                          "env/turn_limit": float(bool(calls))})
        if final:
            graded = self._final_steps([samples[i] for i in final], final_texts, extra)
            for i, step in zip(final, graded):
                steps[i] = step
        return steps

    def _tool_step(self, calls: list[str]) -> EnvStep:
        results = [self.calculator(expr) for expr in calls[: self.config.max_calls_per_turn]]
        lines = [f"<result>{r}</result>" for r in results]
        if len(calls) > self.config.max_calls_per_turn:
            lines.append(f"<result>error: at most {self.config.max_calls_per_turn} calculator calls per turn</result>")
        errors = sum(r.startswith("error:") for r in results) + (len(calls) > len(results))
        return EnvStep(reward=0.0, done=False, observation="\n".join(lines),
                       metrics={"env/tool_calls": float(len(calls)), "env/tool_errors": float(errors)})


def _check_lengths(samples: list[Sample], histories: list[list[str]]) -> None:
    if len(samples) != len(histories):  # a caller bug, not model output
        raise ValueError(f"step() got {len(samples)} samples but {len(histories)} histories")


def build_math_env(section_config: MathEnvConfig | None) -> MathEnvironment:
    return MathEnvironment(section_config)


def build_math_tool_env(section_config: MathToolEnvConfig | None) -> MathToolEnvironment:
    return MathToolEnvironment(section_config)
