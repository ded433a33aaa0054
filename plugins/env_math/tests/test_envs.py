"""The math and math_tool environments, built through the plugin registry from validated config."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from rlcore.config import ConfigError
from rlcore.config.structure import structure
from rlcore.interfaces import EnvStep, Environment, Sample
from rlcore.plugins import get_plugin_manager
from rlcore_math.config import MathEnvConfig, MathToolEnvConfig

pytestmark = pytest.mark.wall_clock


def _build(name: str, **section):
    reg = get_plugin_manager().get("environment", name)
    assert reg.section == f"env.{name}"
    return reg.build(structure(reg.config_cls, section, reg.section))


@pytest.fixture(scope="module")
def math_env():
    env = _build("math", num_workers=2, timeout_s=2.0, format_reward=0.25, answer_format="boxed")
    yield env
    env.close()


def test_registered_with_torch_free_configs():
    manager = get_plugin_manager()
    assert manager.get("environment", "math").config_cls is MathEnvConfig
    assert manager.get("environment", "math_tool").config_cls is MathToolEnvConfig
    assert manager.get("environment", "math_tool").capabilities["multi_turn"] is True
    assert {"math_jsonl", "arithmetic"} <= set(manager.registry["dataset"])


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"env\.math\.num_workrs.*did you mean 'env\.math\.num_workers'"):
        structure(MathEnvConfig, {"num_workrs": 2}, "env.math")
    with pytest.raises(ConfigError, match=r"env\.math\.executor"):
        structure(MathEnvConfig, {"executor": "threads"}, "env.math")
    with pytest.raises(ConfigError, match=r"env\.math\b"):
        structure(MathEnvConfig, {"timeout_s": 0}, "env.math")


def test_math_env_scores_a_batch(math_env):
    assert isinstance(math_env, Environment)
    samples = [Sample(prompt="q", answer=a) for a in ("72", "\\frac{1}{2}", "5", "3", "7")]
    histories = [["<think>...</think> #### 72"], ["first try", "\\boxed{0.5}"], ["no idea"], ["\\boxed{" * 2000], [""]]
    steps = math_env.step(samples, histories)
    assert all(isinstance(s, EnvStep) and s.done and s.observation is None for s in steps)
    assert [s.reward for s in steps] == [1.0, 1.25, 0.0, 0.0, 0.0]
    assert [s.metrics["env/correct"] for s in steps] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert steps[2].metrics["env/parse_error"] == 1.0 and steps[3].metrics["env/rejected"] == 1.0
    assert all(set(s.metrics) == set(steps[0].metrics) for s in steps)


def test_math_env_never_raises_on_odd_histories(math_env):
    samples = [Sample(prompt="q", answer="1")] * 3
    steps = math_env.step(samples, [[], [None], [123]])
    assert [s.reward for s in steps] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 samples but 1 histories"):
        math_env.step(samples[:2], [["1"]])


@pytest.fixture(scope="module")
def tool_env():
    env = _build("math_tool", executor="inline", max_turns=3)
    yield env
    env.close()


def test_calculator_turn_then_graded_answer(tool_env):
    sample = Sample(prompt="What is 12 times 7?", answer="84")
    first = tool_env.step([sample], [["Let me compute. <calc>12*7</calc>"]])[0]
    assert (first.done, first.reward, first.observation) == (False, 0.0, "<result>84</result>")
    assert first.metrics == {"env/tool_calls": 1.0, "env/tool_errors": 0.0}
    final = tool_env.step([sample], [["<calc>12*7</calc>", "The answer is 84."]])[0]
    assert final.done and final.reward == 1.0
    assert final.metrics["env/turns"] == 2.0 and final.metrics["env/turn_limit"] == 0.0


def test_unclosed_call_from_a_stop_string_is_evaluated(tool_env):
    step = tool_env.step([Sample(prompt="q", answer="3")], [["I will use the tool <calc>1+2"]])[0]
    assert step.observation == "<result>3</result>" and not step.done


def test_refusals_are_observations_not_exceptions(tool_env):
    sample = Sample(prompt="q", answer="1")
    for expression, reason in [("__import__('os')", "function call"), ("(1).real", "attribute access"),
                               ("9**9**9", "too large"), ("1" * 10_000, "too long")]:
        step = tool_env.step([sample], [[f"<calc>{expression}</calc>"]])[0]
        assert not step.done and step.observation.startswith("<result>error: ") and reason in step.observation
        assert step.metrics["env/tool_errors"] == 1.0


def test_several_calls_in_a_turn_and_call_limit():
    env = _build("math_tool", executor="inline", max_calls_per_turn=2)
    step = env.step([Sample(prompt="q", answer="1")], [["<calc>1+1</calc> <calc>2*3</calc> <calc>4-1</calc>"]])[0]
    assert step.observation.splitlines() == ["<result>2</result>", "<result>6</result>",
                                             "<result>error: at most 2 calculator calls per turn</result>"]
    assert step.metrics == {"env/tool_calls": 3.0, "env/tool_errors": 1.0}


def test_turn_limit_ends_the_trajectory(tool_env):
    sample = Sample(prompt="q", answer="5")
    history = ["<calc>2+3</calc>", "<calc>2+3</calc>", "still checking <calc>2+3</calc>"]
    step = tool_env.step([sample], [history])[0]
    assert step.done and step.reward == 0.0  # the calc block is not an answer
    assert step.metrics["env/turn_limit"] == 1.0 and step.metrics["env/parse_error"] == 1.0


def test_mixed_batch_keeps_order(tool_env):
    samples = [Sample(prompt="q", answer="6"), Sample(prompt="q", answer="9"), Sample(prompt="q", answer="4")]
    steps = tool_env.step(samples, [["<calc>2*3</calc>"], ["The answer is 9"], ["#### 5"]])
    assert [(s.done, s.reward) for s in steps] == [(False, 0.0), (True, 1.0), (True, 0.0)]


def test_ray_executor_grades_like_the_process_pool():
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="rlm-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        env = _build("math", executor="ray", num_workers=1, timeout_s=1.0)
        samples = [Sample(prompt="q", answer=a) for a in ("72", "1", "\\frac12")]
        steps = env.step(samples, [["#### 72"], ["\\boxed{9^{9^{9}}}"], ["\\boxed{0.5}"]])
        assert [s.reward for s in steps] == [1.0, 0.0, 1.0]
        assert steps[1].metrics["env/timeout"] == 1.0
        env.close()
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
