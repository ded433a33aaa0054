"""The environment suite (:class:`EnvironmentConformance`): an environment never raises on model
output, answers every trajectory with a finite reward, is deterministic and leaves its inputs alone."""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import pytest

from rlcore.interfaces import ClosableEnvironment, Environment, EnvStep, Named, Sample
from rlcore.testing.conformance.members import assert_follows

# Model output an environment must survive: empty, control characters, unpaired surrogates,
# mixed scripts, huge text, nesting bombs, numbers that explode when evaluated, code that loops.
JUNK_RESPONSES: dict[str, str] = {
    "empty": "",
    "whitespace": " \n\t\r\n ",
    "control": "\x00\x01\x02\x1b[31m\x7f",
    "surrogate": "answer \ud800 \udfff",
    "unicode": "答案是 ４２ 🙂 \u202eRTL\u202c \u200b∑∞√ Ω≈ç",
    "huge_digits": "9" * 200_000,
    "huge_words": "the answer is " * 20_000,
    "boxed_bomb": "\\boxed{" * 5_000 + "1" + "}" * 4_000,
    "paren_bomb": "(" * 20_000,
    "power_tower": "\\boxed{9^{9^{9^{9^{9^{9}}}}}} 10**10**10**10",
    "huge_float": "\\boxed{1e999999999} -inf nan NaN 0/0 \\frac{1}{0}",
    "unclosed_tags": "<think>" * 1_000 + "<answer>",
    "code_loop": "```python\nwhile True:\n    pass\n```",
    "latex_junk": "$$\\frac{\\sqrt{}}{\\left(} \\begin{matrix} & \\\\ \\end{pmatrix}$$",
}


def default_samples() -> list[Sample]:
    return [
        Sample(prompt="What is 2 + 3? Put the answer in \\boxed{}.", answer="5", index=0),
        Sample(prompt=[{"role": "user", "content": "Compute 7 * 6."}], answer="42", index=1),
        Sample(prompt="Simplify 1/2 + 1/4.", answer="\\frac{3}{4}", index=2),
    ]


def _check_env_steps(steps: Any, n: int, where: str) -> None:
    assert isinstance(steps, list), f"{where}: step() must return a list, got {type(steps).__name__}"
    assert len(steps) == n, f"{where}: step() returned {len(steps)} results for {n} trajectories"
    for i, step in enumerate(steps):
        assert isinstance(step, EnvStep), f"{where}: result {i} is a {type(step).__name__}, not an EnvStep"
        assert isinstance(step.reward, (int, float)) and not isinstance(step.reward, bool), \
            f"{where}: reward {i} is {step.reward!r}, not a number"
        assert math.isfinite(step.reward), f"{where}: reward {i} is {step.reward}"
        assert isinstance(step.done, bool), f"{where}: done {i} is {step.done!r}, not a bool"
        if not step.done:
            assert isinstance(step.observation, str), f"{where}: trajectory {i} continues without an observation"
        for key, value in step.metrics.items():
            assert isinstance(key, str) and isinstance(value, (int, float)) and math.isfinite(value), \
                f"{where}: metric {key!r} of result {i} is {value!r}"


def _env_key(steps: list[EnvStep]) -> list[tuple]:
    return [(float(s.reward), s.done, s.observation, sorted(s.metrics.items())) for s in steps]


class EnvironmentConformance:
    """An environment is pure: it never raises on model output, answers every trajectory with a
    finite reward, is deterministic, and does not modify its inputs."""

    max_step_seconds: float = 60.0  # for one step() over every junk response

    @pytest.fixture
    def env_samples(self) -> list[Sample]:
        """Samples the environment can score (answers in its own format)."""
        return default_samples()

    @pytest.fixture
    def env_graded_examples(self) -> list[tuple[Sample, list[str], float]] | None:
        """``(sample, history, expected reward)`` triples checked exactly; None skips that test."""
        return None

    def test_implements_protocol(self, environment):
        assert_follows(environment, Environment)
        if isinstance(environment, Named):  # optional: what messages call it
            assert isinstance(environment.name, str) and environment.name, f"name is {environment.name!r}"
        if isinstance(environment, ClosableEnvironment):  # optional: called once as the run ends
            assert callable(environment.close), f"close is {environment.close!r}, not a method"

    def test_one_step_per_trajectory(self, environment, env_samples):
        histories = [[f"The answer is \\boxed{{{s.answer}}}."] for s in env_samples]
        _check_env_steps(environment.step(env_samples, histories), len(env_samples), "plausible answers")

    def test_empty_batch(self, environment):
        assert environment.step([], []) == []

    def test_never_raises_on_junk(self, environment, env_samples):
        names = list(JUNK_RESPONSES)
        samples = [env_samples[i % len(env_samples)] for i in range(len(names))]
        start = time.perf_counter()
        try:
            steps = environment.step(samples, [[JUNK_RESPONSES[name]] for name in names])
        except Exception as exc:  # noqa: BLE001 - find which input broke it, for the message
            culprits = []
            for name, sample in zip(names, samples):
                try:
                    environment.step([sample], [[JUNK_RESPONSES[name]]])
                except Exception as inner:  # noqa: BLE001
                    culprits.append(f"{name}: {inner!r}")
            pytest.fail(f"step() raised {exc!r} on model output; failing inputs: {culprits}")
        elapsed = time.perf_counter() - start
        _check_env_steps(steps, len(names), "junk responses")
        assert elapsed < self.max_step_seconds, f"step() over junk took {elapsed:.1f} s: reward functions need timeouts"

    def test_multi_turn_histories(self, environment, env_samples):
        histories = [["Let me think.", "Still thinking...", f"So it is {s.answer}."] for s in env_samples]
        _check_env_steps(environment.step(env_samples, histories), len(env_samples), "three-turn histories")

    def test_deterministic(self, environment, env_samples):
        histories = [[f"\\boxed{{{s.answer}}}"] if i % 2 else ["no idea"] for i, s in enumerate(env_samples)]
        first = environment.step(env_samples, histories)
        second = environment.step(env_samples, histories)
        assert _env_key(first) == _env_key(second)

    def test_does_not_modify_inputs(self, environment, env_samples):
        histories = [[f"\\boxed{{{s.answer}}}"] for s in env_samples]
        samples_before, histories_before = copy.deepcopy(env_samples), copy.deepcopy(histories)
        environment.step(env_samples, histories)
        assert histories == histories_before and env_samples == samples_before

    def test_graded_examples(self, environment, env_graded_examples):
        if env_graded_examples is None:
            pytest.skip("no env_graded_examples fixture")
        samples = [s for s, _, _ in env_graded_examples]
        steps = environment.step(samples, [h for _, h, _ in env_graded_examples])
        _check_env_steps(steps, len(samples), "graded examples")
        got = [s.reward for s in steps]
        want = [r for _, _, r in env_graded_examples]
        assert got == pytest.approx(want), f"rewards {got}, expected {want}"


