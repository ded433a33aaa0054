"""rlcore's conformance suites applied to the environments and algorithms installed here.

Every registered algorithm (rlcore's built-ins) and environment (rlcore-math's, and any other
installed plugin's) is built from its registration with its default config, the way a run
builds it, and must pass the suite of its kind.
"""

from __future__ import annotations

import pytest

from rlcore.config import structure
from rlcore.interfaces import Placement, Sample
from rlcore.plugins import get_plugin_manager
from rlcore.testing.conformance import AlgorithmConformance, EnvironmentConformance, GeneratorConformance

MANAGER = get_plugin_manager()
# Algorithms trained on preference pairs (dpo, reward_model) have no rollout advantages; their
# losses have their own hand-computed tests (test_dpo.py, test_reward_model.py).
ALGORITHMS = sorted(name for name, reg in MANAGER.registry["algorithm"].items() if reg.capabilities.get("trains_on") != "pairs")
# Non-default settings that switch on the optional loss paths (reference KL, truncated IS,
# dual clip, sequence-level reduction, leave-one-out baselines).
ALGORITHM_VARIANTS = [
    ("grpo", {"kl_coef": 0.1, "kl_estimator": "k2", "gen_is_cap": 2.0, "ratio_clip_c": 3.0, "loss_level": "sequence"}),
    ("grpo", {"leave_one_out_baseline": True, "normalize_std": False, "use_old_logprobs": False}),
    ("dapo", {"overlong_buffer_length": 4, "max_response_length": 10, "kl_coef": 0.05}),
    ("reinforce_pp", {"group_baseline": False, "kl_coef": 0.01, "kl_estimator": "k1"}),
]
# An environment registered with conformance="plugin" grades its own dataset's structured samples
# (hidden tests, a generator's entry) or is scored by an agent, not by text answers: its own tests
# hold it to its contract.
ENVIRONMENTS = sorted(name for name, reg in MANAGER.registry["environment"].items()
                      if reg.capabilities.get("conformance") != "plugin")
# Configs that keep these tests in-process and quick; other settings are the plugin's defaults.
ENV_SETTINGS = {"math": {"executor": "inline"}, "math_tool": {"executor": "inline"}}


def _build(kind: str, name: str, settings: dict):
    reg = MANAGER.get(kind, name)
    data = dict(settings)
    if kind == "algorithm":
        data["name"] = name
    config = structure(reg.config_cls, data, reg.section) if reg.config_cls is not None else None
    return reg.build(config)


def test_builtin_algorithms_are_registered():
    assert {"grpo", "dapo", "gspo", "dr_grpo", "rloo", "reinforce_pp", "sft"} <= set(ALGORITHMS)


@pytest.mark.parametrize("name", ALGORITHMS)
class TestRegisteredAlgorithms(AlgorithmConformance):
    @pytest.fixture
    def algorithm_name(self, name):
        return name

    @pytest.fixture
    def algorithm(self, name):
        return _build("algorithm", name, {})


@pytest.mark.parametrize("name, settings", ALGORITHM_VARIANTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ALGORITHM_VARIANTS)])
class TestAlgorithmVariants(AlgorithmConformance):
    @pytest.fixture
    def algorithm_name(self, name):
        return name

    @pytest.fixture
    def algorithm(self, name, settings):
        if name not in ALGORITHMS:
            pytest.fail(f"algorithm {name!r} is not registered")
        return _build("algorithm", name, settings)


@pytest.mark.skipif(not ENVIRONMENTS, reason="no environment plugin installed")
@pytest.mark.parametrize("name", ENVIRONMENTS, scope="class")
class TestRegisteredEnvironments(EnvironmentConformance):
    @pytest.fixture(scope="class")
    def environment(self, name, tiny_model_dir):
        # reward_model scores with a checkpoint: the tiny causal LM with a fresh score head
        settings = {"model": str(tiny_model_dir)} if name == "reward_model" else ENV_SETTINGS.get(name, {})
        env = _build("environment", name, settings)
        yield env
        close = getattr(env, "close", None)
        if close is not None:
            close()

    @pytest.fixture
    def env_graded_examples(self, name):
        if not name.startswith("math"):
            return None
        question = Sample(prompt="What is 2 + 3?", answer="5")
        return [(question, ["The answer is \\boxed{5}."], 1.0), (question, ["The answer is \\boxed{6}."], 0.0)]


# ---- the suites catch broken implementations ------------------------------------------------
class _RaisesOnJunk:
    def step(self, samples, histories):
        from rlcore.interfaces import EnvStep

        return [EnvStep(reward=float(len(h[-1].encode("utf-8")) < 100)) for h in histories]


class _NaNReward:
    def step(self, samples, histories):
        from rlcore.interfaces import EnvStep

        return [EnvStep(reward=float("nan") if not h[-1] else 1.0) for h in histories]


class _Mutates:
    def step(self, samples, histories):
        from rlcore.interfaces import EnvStep

        for h in histories:
            h.append("seen")
        return [EnvStep() for _ in histories]


@pytest.mark.parametrize("env, test", [
    (_RaisesOnJunk(), "test_never_raises_on_junk"),  # UnicodeEncodeError on a lone surrogate
    (_NaNReward(), "test_never_raises_on_junk"),
    (_Mutates(), "test_does_not_modify_inputs"),
])
def test_environment_suite_catches(env, test):
    from rlcore.testing.conformance import default_samples

    with pytest.raises((AssertionError, pytest.fail.Exception)):
        getattr(EnvironmentConformance(), test)(env, default_samples())


def test_algorithm_suite_catches_micro_batch_local_normalization():
    """A loss divided by the micro-batch's own token count is the classic bug the suite exists for."""
    import torch

    grpo = _build("algorithm", "grpo", {})

    class LocalMean(type(grpo)):
        def loss(self, logprobs_T, mb, totals):
            local = type(totals)(num_valid_tokens=max(1, int(mb.loss_mask_T.sum())), num_valid_seqs=max(1, mb.num_seqs))
            return super().loss(logprobs_T, mb, local)

    suite = AlgorithmConformance()
    suite.test_micro_batch_losses_sum_to_the_step_loss(grpo, 1, 24, 1)  # the real one passes
    with pytest.raises(AssertionError):
        suite.test_micro_batch_losses_sum_to_the_step_loss(LocalMean(grpo.config), 1, 24, 1)
    assert torch.is_tensor(grpo.advantages(torch.ones(2), torch.zeros(2, dtype=torch.long)))


# ---- rlcore's built-in generator ----------------------------------------------------------------
class TestBuiltinHFGenerator(GeneratorConformance):
    @pytest.fixture(scope="class")
    def generator_model_dir(self, tiny_model_dir):
        return tiny_model_dir

    @pytest.fixture(scope="class")
    def generator(self, generator_model_dir):
        from rlcore.loading.loader import build_config

        config = build_config({"policy": {"model_name": str(generator_model_dir), "generation": {"backend": "hf"}}})
        return MANAGER.get("generator", "hf").build(config, config.generation, Placement())
