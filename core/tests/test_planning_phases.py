"""The planner's step beyond synchronous GRPO: PPO's critic (its two phases and its memory beside the
policy's) and one-step-off overlap (generation beside the trainer's phases)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlcore.loading.loader import build_config
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


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     ("q_proj", "v_proj"), ("linear_qkv", "linear_fc2")])
def test_the_adapter_count_is_the_one_peft_builds(targets):
    """LoRA's trainable weights as the planner counts them equal those ``peft`` puts on the transformers model
    (Megatron's fused names count as the Hugging Face projections they carry)."""
    import peft
    import torch
    import transformers

    from rlcore.planning.shapes import from_hf_config

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, vocab_size=1000)
    hf_names = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_fc2": ["down_proj"]}
    modules = [n for t in targets for n in hf_names.get(t, [t])]
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                    peft.LoraConfig(r=8, lora_alpha=16, target_modules=modules))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert from_hf_config("llama", config.to_dict()).lora_params(8, targets) == trainable


def test_lora_trains_adapters_only_the_frozen_base_kept_in_the_dtype_on_megatron(shipped):
    single = {"tensor_model_parallel_size": 1, "sequence_parallel": False}  # 8 data-parallel ranks
    full = inputs(RECIPE_8B, shipped, policy__megatron_cfg__tensor_model_parallel_size=1, policy__megatron_cfg__sequence_parallel=False)
    lora = inputs(RECIPE_8B, shipped, policy__lora={"enabled": True, "rank": 16}, **{f"policy__megatron_cfg__{k}": v for k, v in single.items()})
    assert 0 < lora.work.lora_params < full.shape.total_params / 100
    full_est, lora_est = plan.evaluate_recipe(full), plan.evaluate_recipe(lora)
    parts = lora_est.memory.train_parts
    # the base in bf16 beside the adapters; gradients and Adam's state (with the fp32 main copy) for the adapters alone
    assert parts["weights"] == pytest.approx((full.shape.total_params + lora.work.lora_params) * 2 / 2**30, rel=0.01)
    dp = lora.recipe_layout.dp(lora.cluster.world)  # the distributed optimizer shards it over the data-parallel ranks
    assert dp == 8 and parts["optimizer"] == pytest.approx(lora.work.lora_params * 12 / dp / 2**30, rel=1e-6)
    assert full_est.memory.train_parts["optimizer"] > 100 * parts["optimizer"]
    # no weight gradients for the base: training is two thirds of the matmul work (attention's core is unchanged)
    assert 0.6 * full_est.phases["training"] < lora_est.phases["training"] < 0.75 * full_est.phases["training"]
