"""Typed configuration: recipes + dotted overrides -> frozen attrs configs, or a ConfigError that
names the full dotted key path (and the closest valid key) before any work starts.

Plugin sections come from a small in-test plugin registered on an isolated manager
(``RLCORE_NO_AUTOLOAD=1``), so these tests do not depend on the repository's plugins.
"""

from __future__ import annotations

from typing import Literal

import attrs
import pytest
import yaml
from attrs import field, frozen

from rlcore import hookimpl
from rlcore.config import ConfigError, RunConfig, doc
from rlcore.loading.loader import build_config, load_config, to_dict
from rlcore.plugins import PluginManager


@frozen
class FakeOptim:
    lr: float = field(default=1e-5, validator=attrs.validators.gt(0), metadata=doc("learning rate"))
    kind: Literal["adam", "sgd"] = field(default="adam", metadata=doc("optimizer"))


@frozen
class FakeBackendConfig:
    enabled: bool = field(default=False, metadata=doc("use this backend"))
    tensor_model_parallel_size: int = field(default=1, validator=attrs.validators.gt(0), metadata=doc("TP"))
    recompute: str | None = field(default=None, metadata=doc("activation recompute mode"))
    layers_to_freeze: list[int] = field(factory=list, metadata=doc("frozen layer indices"))
    optim: FakeOptim = field(factory=FakeOptim, metadata=doc("optimizer"))
    extra: FakeOptim | None = field(default=None, metadata=doc("optional nested block"))


@frozen
class FakeEnvConfig:
    difficulty: int = field(default=1, metadata=doc("level"))
    tags: tuple[str, ...] = field(default=(), metadata=doc("labels"))


@frozen
class FakeAlgoConfig:
    name: Literal["fakealgo"] = field(default="fakealgo", metadata=doc("algorithm"))
    clip: float = field(default=0.2, metadata=doc("ratio clip"))


class FakePlugin:
    @hookimpl
    def rlcore_training_backends(self, register):
        register("fakebackend", "x:y", FakeBackendConfig, section="policy.fake_cfg")

    @hookimpl
    def rlcore_environments(self, register):
        register("fakeenv", "x:y", FakeEnvConfig)
        register("noconfig", "x:y")

    @hookimpl
    def rlcore_algorithms(self, register):
        register("fakealgo", "x:y", FakeAlgoConfig)


@pytest.fixture(scope="module")
def manager():
    mp = pytest.MonkeyPatch()
    mp.setenv("RLCORE_NO_AUTOLOAD", "1")
    manager = PluginManager()
    manager.load_entry_points()
    manager.register_module(FakePlugin())
    mp.undo()
    return manager


BASE = {"policy": {"model_name": "/models/tiny", "fake_cfg": {"enabled": True}}, "env": {"name": "fakeenv"}}


def build(manager, overrides=(), data=None) -> RunConfig:
    return build_config(BASE if data is None else data, list(overrides), manager)


def error(manager, overrides=(), data=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build(manager, overrides, data)
    return info.value


# ---- valid configs --------------------------------------------------------------------------
def test_defaults_and_plugin_sections(manager):
    config = build(manager)
    assert config.policy.model_name == "/models/tiny"
    assert config.grpo.num_generations_per_prompt == 8 and config.cluster.gpus_per_node == 0
    backend = config.section("policy.fake_cfg")
    assert isinstance(backend, FakeBackendConfig) and backend.enabled and backend.optim == FakeOptim()
    # A section the recipe leaves out still gets its schema's defaults.
    assert config.section("env.fakeenv") == FakeEnvConfig()
    assert config.section("algorithm") is None  # shared section: absent means unset
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.policy.model_name = "other"  # type: ignore[misc]


def test_shared_section_picks_provider_by_name(manager):
    config = build(manager, ["algorithm.name=fakealgo", "algorithm.clip=0.3"])
    assert config.section("algorithm") == FakeAlgoConfig(clip=0.3)
    err = error(manager, ["algorithm.name=fakealog"])
    assert err.key == "algorithm.name" and "did you mean 'fakealgo'" in str(err)
    err = error(manager, ["algorithm.clip=0.3"])
    assert err.key == "algorithm.name" and "required" in str(err)


def test_to_dict_round_trips(manager):
    config = build(manager, ["algorithm.name=fakealgo", "policy.fake_cfg.layers_to_freeze=[0,1]"])
    data = to_dict(config)
    assert data["policy"]["fake_cfg"]["layers_to_freeze"] == [0, 1]
    assert data["env"]["fakeenv"] == {"difficulty": 1, "tags": []}
    assert data["algorithm"] == {"name": "fakealgo", "clip": 0.2}
    again = build_config(yaml.safe_load(yaml.safe_dump(data)), [], manager)
    assert again == config


# ---- unknown keys: full dotted path + closest valid key --------------------------------------
@pytest.mark.parametrize("override, key, suggestion", [
    ("grpoo.max_num_steps=3", "grpoo", "grpo"),
    ("train.max_num_step=3", "train.max_num_step", "train.max_num_steps"),
    ("policy.optimizer.lrr=1e-5", "policy.optimizer.lrr", "policy.optimizer.lr"),
    ("grpo.async_grpo.enabeld=true", "grpo.async_grpo.enabeld", "grpo.async_grpo.enabled"),
    ("policy.fake_cfg.tensor_model_parallel_sise=2", "policy.fake_cfg.tensor_model_parallel_sise", "policy.fake_cfg.tensor_model_parallel_size"),
    ("policy.fake_cfg.optim.lr_=1", "policy.fake_cfg.optim.lr_", "policy.fake_cfg.optim.lr"),
    ("policy.fake_cfg.extra.kindd=sgd", "policy.fake_cfg.extra.kindd", "policy.fake_cfg.extra.kind"),
    ("env.fakeenv.dificulty=2", "env.fakeenv.dificulty", "env.fakeenv.difficulty"),
    ("env.fakeenvv.difficulty=2", "env.fakeenvv", "env.fakeenv"),
    ("policy.fake_cgf.enabled=true", "policy.fake_cgf", "policy.fake_cfg"),
    ("algorithm.clipp=1", "algorithm.clipp", "algorithm.clip"),
])
def test_unknown_key_names_path_and_closest(manager, override, key, suggestion):
    overrides = [override] + (["algorithm.name=fakealgo"] if override.startswith("algorithm") else [])
    err = error(manager, overrides)
    assert err.key == key
    assert f"config key '{key}'" in str(err) and f"did you mean '{suggestion}'?" in str(err)


def test_unknown_key_in_yaml_and_without_close_match(manager):
    data = {**BASE, "cluster": {"zzz": 1}}
    err = error(manager, data=data)
    assert err.key == "cluster.zzz" and "valid keys here:" in str(err) and "gpus_per_node" in str(err)
    err = error(manager, ["env.noconfig.anything=1"])
    assert err.key == "env.noconfig.anything"


def test_missing_required_key(manager):
    err = error(manager, data={"train": {"seed": 1}})
    assert err.key == "policy" and "required key is missing" in str(err)
    err = error(manager, data={"policy": {"tokenizer_name": "t"}})
    assert err.key == "policy.model_name" and "required key is missing (Hugging Face model: a local directory or a hub id" in str(err)
    err = error(manager, data={"policy": {"model_name": None}})
    assert err.key == "policy.model_name" and "expected a string, got None" in str(err)
    # On the command line a string field takes the text as written.
    assert build(manager, ["policy.model_name=null"]).policy.model_name == "null"


def test_validator_failures_name_the_field(manager):
    err = error(manager, ["train.max_num_steps=0"])
    assert err.key == "train.max_num_steps" and "must be > 0" in str(err)
    err = error(manager, ["policy.fake_cfg.optim.lr=-1"])
    assert err.key == "policy.fake_cfg.optim.lr"


# ---- typed overrides -------------------------------------------------------------------------
def test_override_types_follow_the_target_field(manager):
    config = build(manager, [
        "train.max_num_steps=7",  # int
        "policy.optimizer.lr=3e-6",  # float written the way YAML 1.1 reads as a string
        "policy.optimizer.min_lr=0",  # an int literal into a float field
        "grpo.async_grpo.enabled=yes",  # bool
        "policy.tokenizer_name=123",  # str stays a string
        "policy.train_global_batch_size=null",  # X | None
        "policy.max_grad_norm=None",
        "policy.optimizer.betas=[0.8, 0.95]",  # tuple[float, float]
        "grpo.summary_window=[2, 5]",  # tuple | None
        "policy.fake_cfg.layers_to_freeze=[1, 3]",  # list[int] in a plugin section
        "policy.fake_cfg.recompute=full",
        "env.fakeenv.tags=[a, b]",
        "policy.scheduler.decay_style=cosine",  # Literal
    ])
    assert config.train.max_num_steps == 7 and type(config.train.max_num_steps) is int
    assert config.policy.optimizer.lr == 3e-6 and type(config.policy.optimizer.lr) is float
    assert config.policy.optimizer.min_lr == 0.0 and type(config.policy.optimizer.min_lr) is float
    assert config.grpo.async_grpo.enabled is True
    assert config.policy.tokenizer_name == "123"
    assert config.policy.train_global_batch_size is None and config.policy.max_grad_norm is None
    assert config.policy.optimizer.betas == (0.8, 0.95)
    assert config.grpo.summary_window == (2, 5)
    assert config.section("policy.fake_cfg").layers_to_freeze == [1, 3]
    assert config.section("policy.fake_cfg").recompute == "full"
    assert config.section("env.fakeenv").tags == ("a", "b")
    assert config.policy.scheduler.decay_style == "cosine"


@pytest.mark.parametrize("override, value", [
    ("policy.generation.gpu_memory_utilization=auto", "auto"),  # float | "auto": each member tried in turn
    ("policy.generation.gpu_memory_utilization=0.4", 0.4),
    ("policy.generation.colocated.offload_trainer_state=auto", "auto"),  # bool | "auto"
    ("policy.generation.colocated.offload_trainer_state=true", True),
])
def test_overrides_into_a_union_with_a_literal_take_either_member(manager, override, value):
    key = override.split("=")[0]
    node = to_dict(build(manager, ["policy.generation.backend=hf", override]))
    for part in key.split("."):
        node = node[part]
    assert node == value and type(node) is type(value)


@pytest.mark.parametrize("override, key, words", [
    ("train.max_num_steps=2.5", "train.max_num_steps", "expected an integer"),
    ("train.max_num_steps=many", "train.max_num_steps", "expected an integer"),
    ("train.max_num_steps=true", "train.max_num_steps", "expected an integer"),
    ("policy.optimizer.lr=fast", "policy.optimizer.lr", "expected a number"),
    ("grpo.async_grpo.enabled=maybe", "grpo.async_grpo.enabled", "expected true/false"),
    ("policy.optimizer.betas=[0.9]", "policy.optimizer.betas", "expected 2 items"),
    ("policy.optimizer.betas=0.9", "policy.optimizer.betas", "expected a list"),
    ("policy.optimizer.betas=[0.9, x]", "policy.optimizer.betas[1]", "expected a number"),
    ("policy.fake_cfg.layers_to_freeze=[1, two]", "policy.fake_cfg.layers_to_freeze[1]", "expected an integer"),
    ("policy.scheduler.decay_style=cosin", "policy.scheduler.decay_style", "did you mean 'cosine'"),
    ("policy.precision=bf16", "policy.precision", "must be one of ['float32', 'bfloat16', 'float16', 'float64']"),
    ("policy.fake_cfg.optim.kind=adamw", "policy.fake_cfg.optim.kind", "did you mean 'adam'"),
    ("policy.fake_cfg.tensor_model_parallel_size=0", "policy.fake_cfg.tensor_model_parallel_size", "must be > 0"),
])
def test_override_type_mistakes_name_the_key(manager, override, key, words):
    err = error(manager, [override])
    assert err.key == key, str(err)
    assert words in str(err)


def test_an_override_matching_no_member_of_a_union_names_the_key(manager):
    err = error(manager, ["policy.generation.backend=hf", "policy.generation.gpu_memory_utilization=most"])
    assert err.key == "policy.generation.gpu_memory_utilization" and "'most' does not match" in str(err)


def test_override_syntax_errors(manager):
    assert "must look like dotted.key=value" in str(error(manager, ["train.max_num_steps"]))
    assert "must look like dotted.key=value" in str(error(manager, ["train..seed=1"]))
    err = error(manager, ["policy.model_name.sub=1"])
    assert err.key == "policy.model_name" and "not a section" in str(err)
    err = error(manager, ["policy=3"])
    assert err.key == "policy"


def test_override_wins_over_yaml_and_creates_sections(manager):
    data = {**BASE, "train": {"max_num_steps": 10}}
    config = build(manager, ["train.max_num_steps=3", "env.fakeenv.difficulty=4"], data)
    assert config.train.max_num_steps == 3 and config.section("env.fakeenv").difficulty == 4
    assert data["train"]["max_num_steps"] == 10  # the caller's dict is not modified


def test_a_tilde_override_removes_a_key_the_recipe_sets(manager):
    # Switching a shared section's provider: the old provider's own keys must go, or they are unknown keys.
    data = {**BASE, "algorithm": {"name": "fakealgo", "clip": 0.3}, "train": {"max_num_steps": 10}}
    assert build(manager, [], data).section("algorithm") == FakeAlgoConfig(clip=0.3)
    config = build(manager, ["~algorithm.clip", "~train.max_num_steps"], data)
    assert config.section("algorithm") == FakeAlgoConfig() and config.train.max_num_steps == build(manager).train.max_num_steps
    assert data["algorithm"] == {"name": "fakealgo", "clip": 0.3}  # the caller's dict is not modified
    # Removed and set again: the overrides apply in order.
    assert build(manager, ["~train.max_num_steps", "train.max_num_steps=4"], data).train.max_num_steps == 4
    err = error(manager, ["~train.seed"], data)
    assert err.key == "train.seed" and "does not set it" in str(err)
    err = error(manager, ["~nosection.key"], data)
    assert err.key == "nosection.key" and "does not set nosection" in str(err)
    err = error(manager, ["~train.max_num_steps=3"], data)
    assert "a removal looks like ~dotted.key" in str(err)
    assert "a removal looks like" in str(error(manager, ["~"], data))


def test_a_key_of_another_provider_names_its_owner_and_the_removal(manager):
    err = error(manager, ["algorithm.name=fakealgo", "algorithm.kl_coef=0.1"])
    assert err.key == "algorithm.kl_coef"
    assert "a key of algorithm.name=grpo, not of fakealgo" in str(err) and "~algorithm.kl_coef" in str(err)
    # A key no provider takes keeps the plain unknown-key error.
    err = error(manager, ["algorithm.name=fakealgo", "algorithm.kl_coeff=0.1"])
    assert "a key of" not in str(err) and "unknown key" in str(err)


# ---- recipes on disk -------------------------------------------------------------------------
def test_the_keys_every_trainer_reads_are_under_train_and_their_old_grpo_spelling_is_named(manager, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("policy: {model_name: m}\n"
                      "grpo: {max_num_steps: 3, num_generations_per_prompt: 4, seed: 1, val_period: 2}\n")
    with pytest.raises(ConfigError) as info:  # the recipe of an older rlcore: every moved key, with its new place
        load_config(recipe, [], manager)
    assert info.value.key == "grpo.max_num_steps"
    assert str(info.value).startswith("config key 'grpo.max_num_steps': moved: write 'train.max_num_steps' instead; "
                                      "likewise grpo.seed -> train.seed, grpo.val_period -> train.val_period (section "
                                      "'train' holds what every trainer reads")
    assert "num_generations_per_prompt" not in str(info.value) and str(recipe) in str(info.value)
    recipe.write_text(yaml.safe_dump({**BASE, "train": {"max_num_steps": 3}, "grpo": {"num_generations_per_prompt": 4}}))
    config = load_config(recipe, ["train.val_at_start=true"], manager)
    assert (config.train.max_num_steps, config.train.val_at_start, config.grpo.num_generations_per_prompt) == (3, True, 4)
    for old in ("max_num_steps", "num_prompts_per_step", "val_period", "val_at_start", "max_val_samples", "seed",
                "deterministic"):  # the command line's old spelling: the same error
        with pytest.raises(ConfigError) as info:
            load_config(recipe, [f"grpo.{old}=1"], manager)
        assert info.value.key == f"grpo.{old}" and f"moved: write 'train.{old}' instead" in str(info.value)


def test_load_config_from_yaml(manager, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(BASE))
    config = load_config(recipe, ["train.seed=5"], manager)
    assert config.train.seed == 5
    recipe.write_text("policy:\n  model_name: m\n  fake_cfg:\n    tensor_model_parallel_sise: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(recipe, [], manager)
    assert info.value.key == "policy.fake_cfg.tensor_model_parallel_sise"
    assert str(recipe) in str(info.value)
    recipe.write_text("policy: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(recipe, [], manager)
    recipe.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(recipe, [], manager)
    with pytest.raises(ConfigError, match="recipe not found"):
        load_config(tmp_path / "missing.yaml", [], manager)
