"""The planner's step beyond synchronous GRPO: PPO's critic (its two phases and its memory beside the
policy's) and one-step-off overlap (generation beside the trainer's phases)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlcore.config.loader import build_config
from rlcore.planning import plan
from rlcore.planning.calibration import load_calibration
from rlcore.planning.search import evaluate
from rlcore.planning.shapes import resolve_shape

ROOT = Path(__file__).resolve().parents[2]
RECIPE_8B = ROOT / "recipes" / "grpo_math_8B_megatron.yaml"  # colocated, Megatron TP=2
RECIPE_ASYNC = ROOT / "recipes" / "grpo_math_8B_async.yaml"  # one step off, FSDP2, generation on 4 GPUs of its own


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_CALIBRATION", str(tmp_path / "none.json"))
    return load_calibration("h200")


def inputs(recipe: Path, shipped, **changes):
    data = yaml.safe_load(recipe.read_text())
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return plan.inputs(build_config(data), gpus=8, response_tokens=800, calibration=shipped)


def test_ppo_plans_the_critics_phases_and_memory(shipped):
    grpo = plan.evaluate_recipe(inputs(RECIPE_8B, shipped, algorithm={"name": "grpo", "kl_coef": 0.0}))
    inp = inputs(RECIPE_8B, shipped, algorithm={"name": "ppo", "kl_coef": 0.0})
    ppo = plan.evaluate_recipe(inp)
    critic = inp.work.critic_model
    assert inp.work.critic and critic.value_head and critic.output_width == 1
    # the critic is the policy's body: the output layer's vocab x hidden weights become one value per token
    policy = inp.shape
    assert policy.total_params - critic.total_params == (policy.vocab - 1) * policy.hidden
    # its phases: a forward and a training pass of a model without the vocabulary's logits
    assert 0 < ppo.phases["values"] < ppo.phases["logprobs"]
    assert 0.7 * ppo.phases["training"] < ppo.phases["critic"] < ppo.phases["training"]
    assert ppo.step_s == pytest.approx(grpo.step_s + ppo.phases["values"] + ppo.phases["critic"], rel=1e-6)
    # its state beside the policy's (rlcore.planning.memory)
    assert ppo.memory.train_parts["critic_state"] > 0 and ppo.memory.peak_gib > grpo.memory.peak_gib


def test_a_critic_released_with_the_trainer_state_moves_each_step(shipped):
    release = {"enabled": True, "offload_trainer_state": True}
    grpo = plan.evaluate_recipe(inputs(RECIPE_8B, shipped, policy__generation__colocated=release))
    ppo = plan.evaluate_recipe(inputs(RECIPE_8B, shipped, algorithm={"name": "ppo"}, policy__generation__colocated=release))
    kept = plan.evaluate_recipe(inputs(RECIPE_8B, shipped, algorithm={"name": "ppo"}))
    assert ppo.phases["offload"] > grpo.phases["offload"] > 0  # the critic's state crosses too
    assert "offload" not in kept.phases or kept.phases["offload"] == 0


def test_a_critic_of_another_model(shipped):
    inp = inputs(RECIPE_8B, shipped, algorithm={"name": "ppo", "critic": {"model_name": "unsloth/Llama-3.2-1B"}})
    small, critic = resolve_shape("unsloth/Llama-3.2-1B"), inp.work.critic_model
    assert small.tied and critic.name == "llama-3.2-1b critic"
    assert critic.total_params == small.total_params + small.hidden  # tied embeddings: the value head is new
    est = plan.evaluate_recipe(inp)
    same = plan.evaluate_recipe(inputs(RECIPE_8B, shipped, algorithm={"name": "ppo"}))
    assert est.phases["critic"] < same.phases["critic"] / 3  # a 1B critic beside an 8B policy


def test_one_step_off_overlaps_generation_with_the_trainers_phases(shipped):
    inp = inputs(RECIPE_ASYNC, shipped)
    assert inp.work.one_step_off and not inp.recipe_layout.colocated
    est = plan.evaluate_recipe(inp)
    p = est.phases
    assert est.overlapped
    assert est.step_s == pytest.approx(max(p["generation"], p["logprobs"] + p["training"]) + p["refit"] + p["offload"])
    assert est.step_s < sum(p.values())
    # colocated, the engines and the trainer share the GPUs: nothing overlaps
    colocated = evaluate(inp.shape, inp.work, inp.recipe_layout.with_(colocated=True, gen_gpus=0), inp.cluster, shipped)
    assert not colocated.overlapped and colocated.step_s == pytest.approx(sum(colocated.phases.values()))
    # the same layout synchronous: the sum
    sync = inputs(RECIPE_ASYNC, shipped, grpo__async_grpo={"enabled": False})
    assert not plan.evaluate_recipe(sync).overlapped
