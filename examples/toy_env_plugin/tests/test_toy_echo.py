"""rlcore's environment conformance suite, run by this plugin's own CI (``pytest`` here)."""

import pytest

from rlcore.interfaces import Sample
from rlcore.plugins import get_plugin_manager
from rlcore.testing.conformance import EnvironmentConformance

from rlcore_toy_env.config import ToyEchoConfig


class TestToyEcho(EnvironmentConformance):
    @pytest.fixture
    def environment(self):
        # Built the way a run builds it: through the installed entry point.
        registration = get_plugin_manager().get("environment", "toy_echo")
        return registration.build(ToyEchoConfig())

    @pytest.fixture
    def env_graded_examples(self):
        sample = Sample(prompt="Say 'Hello World'.", answer="Hello World")
        return [
            (sample, ["hello   world"], 1.0),
            (sample, ["Hello"], 0.0),
            (sample, ["I think", "Hello World"], 1.0),  # only the last turn counts
            (sample, ["x" * 5000], 0.0),
        ]


def test_case_sensitive_setting():
    from rlcore_toy_env.env import build

    sample = Sample(prompt="", answer="Yes")
    env = build(ToyEchoConfig(case_sensitive=True, reward_correct=2.0, reward_wrong=-1.0))
    assert [s.reward for s in env.step([sample, sample], [["Yes"], ["yes"]])] == [2.0, -1.0]
