"""The planner reads architectures truly: mixtures of experts with routed and shared experts and dense
layers, latent attention (its parameters and its compressed KV cache), and refuses what it cannot count.

``data/planning/*/config.json`` are the published ``config.json`` files of DeepSeek-V3 and
Qwen3-235B-A22B; the other configs are written inline from their published fields. Parameter counts are
held to the model cards' totals within 0.5% (they are rounded to three digits) and active counts within 3%
(the cards round to two: "37B", "22B").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.config import ConfigError
from rlcore.planning.shapes import from_hf_config, resolve_shape

DATA = Path(__file__).parent / "data" / "planning"

MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
QWEN15_MOE_A27B = dict(model_type="qwen2_moe", hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=16, intermediate_size=5632, moe_intermediate_size=1408,
                       shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4, vocab_size=151936)


def active(shape) -> float:
    return shape.active_matmul_params + shape.vocab * shape.hidden  # the cards count the embedding lookup too


def test_deepseek_v3_reads_as_671b_total_37b_active_with_a_latent_kv_cache():
    shape = resolve_shape(str(DATA / "DeepSeek-V3"))
    assert shape.total_params == pytest.approx(671e9, rel=0.005)
    assert active(shape) == pytest.approx(37e9, rel=0.03)
    assert (shape.experts, shape.topk, shape.dense_layers, shape.moe_layers) == (256, 8, 3, 58)
    assert shape.shared_ffn == 2048 and shape.mla is not None
    # the engine caches one 512-wide latent and one 64-wide rotary key a token and layer, whole on each TP rank
    assert shape.kv_bytes_per_token(2) == 61 * (512 + 64) * 2
    assert shape.kv_shards(8) == 1
    # a grouped-query model of the same width would cache 2 * 128 heads * 128 dims: MLA's cache is 57x smaller
    assert 2 * 128 * 128 / (512 + 64) > 50


def test_qwen3_235b_a22b_reads_as_235b_total_22b_active():
    shape = resolve_shape(str(DATA / "Qwen3-235B-A22B"))
    assert shape.total_params == pytest.approx(235e9, rel=0.005)
    assert active(shape) == pytest.approx(22e9, rel=0.03)
    assert shape.kv_shards(8) == 4  # 4 key-value heads: replicated past four engine ranks


def test_mixtral_and_shared_expert_models():
    mixtral = from_hf_config("Mixtral-8x7B", MIXTRAL_8X7B)
    assert mixtral.total_params == pytest.approx(46.7e9, rel=0.005)
    assert active(mixtral) == pytest.approx(12.9e9, rel=0.01)
    qwen = from_hf_config("Qwen1.5-MoE-A2.7B", QWEN15_MOE_A27B)  # 4 shared experts of 1408, summed: 5632
    assert qwen.total_params == pytest.approx(14.3e9, rel=0.005)
    assert active(qwen) == pytest.approx(2.7e9, rel=0.01)
    # experts in every second layer (decoder_sparse_step 2) but layer 1 (mlp_only_layers)
    stepped = from_hf_config("stepped", {**QWEN15_MOE_A27B, "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert stepped.dense_layers == 13 and stepped.moe_layers == 11  # odd layers 1, 3, ... hold experts; layer 1 made dense
    assert stepped.total_params < qwen.total_params


def test_an_unknown_architecture_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"policy.model_name.*model_type 'gemma2'.*deepseek_v3"):
        from_hf_config("gemma", {**MIXTRAL_8X7B, "model_type": "gemma2"})
    with pytest.raises(ConfigError, match="model_type None"):
        from_hf_config("no-type", {k: v for k, v in MIXTRAL_8X7B.items() if k != "model_type"})


def test_missing_fields_are_named_all_at_once(tmp_path):
    cfg = json.loads((DATA / "DeepSeek-V3" / "config.json").read_text())
    for key in ("kv_lora_rank", "v_head_dim", "q_lora_rank"):
        del cfg[key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="lacks 'q_lora_rank', 'kv_lora_rank', 'v_head_dim'") as exc:
        resolve_shape(str(tmp_path))
    assert exc.value.key == "policy.model_name"
    moe = {k: v for k, v in QWEN15_MOE_A27B.items() if k not in ("num_experts", "moe_intermediate_size")}
    with pytest.raises(ConfigError, match=r"lacks 'num_experts' \(or 'num_local_experts'\), 'moe_intermediate_size'"):
        from_hf_config("qwen-moe", moe)
    # DeepSeek-V2-Lite projects queries directly (q_lora_rank null): read, not refused
    lite = {**json.loads((DATA / "DeepSeek-V3" / "config.json").read_text()), "model_type": "deepseek_v2", "q_lora_rank": None}
    assert from_hf_config("lite", lite).mla.q_lora_rank == 0


def test_invalid_values_are_named():
    with pytest.raises(ConfigError, match=r"num_hidden_layers=-5 \(expected an integer >= 1\)"):
        from_hf_config("bad", {**MIXTRAL_8X7B, "num_hidden_layers": -5})
    with pytest.raises(ConfigError, match="num_attention_heads=32 is not a multiple of num_key_value_heads=5"):
        from_hf_config("bad", {**MIXTRAL_8X7B, "num_key_value_heads": 5})
    with pytest.raises(ConfigError, match="num_experts_per_tok=9 is more than the 8 routed experts"):
        from_hf_config("bad", {**MIXTRAL_8X7B, "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match="moe_layer_freq=2"):
        from_hf_config("bad", {**json.loads((DATA / "DeepSeek-V3" / "config.json").read_text()), "moe_layer_freq": 2})
    with pytest.raises(ConfigError, match="--layers"):
        resolve_shape("meta-llama/Llama-3.1-8B", layers=-5)


def test_a_vision_language_config_is_read_through_its_text_config():
    text = {"model_type": "qwen2_5_vl_text", "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
            "num_key_value_heads": 2, "intermediate_size": 11008, "vocab_size": 151936, "tie_word_embeddings": True}
    shape = from_hf_config("Qwen2.5-VL-3B", {"model_type": "qwen2_5_vl", "text_config": text, "vision_config": {}})
    assert shape.layers == 36 and shape.total_params == pytest.approx(3.09e9, rel=0.01)  # the language model alone


SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, vocab_size=1000)
DEEPSEEK_SMALL = dict(**SMALL, moe_intermediate_size=128, num_hidden_layers=4, num_key_value_heads=4, n_routed_experts=8,
                      num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=32,
                      qk_rope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1)
TRANSFORMERS_MODELS = {
    "llama": ("LlamaConfig", dict(**SMALL, num_hidden_layers=2, num_key_value_heads=2)),
    "llama-biases": ("LlamaConfig", dict(**SMALL, num_hidden_layers=2, num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(**SMALL, num_hidden_layers=2, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(**SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=64)),
    "mixtral": ("MixtralConfig", dict(**SMALL, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(**SMALL, num_hidden_layers=2, num_key_value_heads=2, moe_intermediate_size=128,
                                         shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=2)),
    "qwen3-moe-stepped": ("Qwen3MoeConfig", dict(**SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=64, moe_intermediate_size=128,
                                                 num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[])),
    "deepseek-v3": ("DeepseekV3Config", dict(**DEEPSEEK_SMALL, n_shared_experts=2, q_lora_rank=64)),
    "deepseek-v3-direct-q": ("DeepseekV3Config", dict(**DEEPSEEK_SMALL, n_shared_experts=1, q_lora_rank=None)),
    "deepseek-v2": ("DeepseekV2Config", dict(**DEEPSEEK_SMALL, n_shared_experts=1, q_lora_rank=64)),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMERS_MODELS))
def test_counts_equal_the_transformers_models_parameters(name):
    """The count from the config equals the parameters of the model transformers builds from it (on the meta
    device), read through transformers' own serialization of the config (``to_dict``)."""
    import torch
    import transformers

    class_name, kwargs = TRANSFORMERS_MODELS[name]
    config = getattr(transformers, class_name)(**kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # DeepSeek-V3's routing score bias is a buffer in transformers, a parameter of the checkpoint
    real = sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers() if "correction_bias" in n)
    assert from_hf_config(name, config.to_dict()).total_params == real
