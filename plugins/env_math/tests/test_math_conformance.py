"""rlcore's environment conformance suite, run on both environments as built from their registry entries."""

from __future__ import annotations

import pytest

from rlcore.config.structure import structure
from rlcore.interfaces import Sample
from rlcore.plugins import get_plugin_manager
from rlcore.testing.conformance import EnvironmentConformance

pytestmark = pytest.mark.wall_clock


def _build(name: str, **section):
    reg = get_plugin_manager().get("environment", name)
    return reg.build(structure(reg.config_cls, section, reg.section))


class TestMathEnvironment(EnvironmentConformance):
    max_step_seconds = 20.0

    @pytest.fixture(scope="class")
    def environment(self):
        env = _build("math", num_workers=2, timeout_s=2.0)
        yield env
        env.close()

    @pytest.fixture
    def env_graded_examples(self):
        return [
            (Sample(prompt="q", answer="5"), ["2 + 3 = 5, so \\boxed{5}"], 1.0),
            (Sample(prompt="q", answer="\\frac{3}{4}"), ["It is 0.75"], 1.0),
            (Sample(prompt="q", answer="42"), ["#### 41"], 0.0),
            (Sample(prompt="q", answer="42"), ["\\boxed{42"], 0.0),
        ]


class TestMathToolEnvironment(EnvironmentConformance):
    max_step_seconds = 20.0

    @pytest.fixture(scope="class")
    def environment(self):
        env = _build("math_tool", num_workers=1, timeout_s=2.0, max_turns=3)
        yield env
        env.close()

    @pytest.fixture
    def env_graded_examples(self):
        return [
            (Sample(prompt="q", answer="42"), ["<calc>7*6</calc>", "The answer is 42."], 1.0),
            (Sample(prompt="q", answer="42"), ["<calc>7*6</calc>"], 0.0),  # continues: reward comes later
            (Sample(prompt="q", answer="42"), ["<calc>1</calc>", "<calc>2</calc>", "<calc>7*6</calc>"], 0.0),
        ]
