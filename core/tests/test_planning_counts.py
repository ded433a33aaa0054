"""The planner's counts from first principles: the activation bytes a Hugging Face decoder layer keeps for backward
(FSDP2's eager model), counted on the layer transformers builds; and decoding with vLLM's paged KV cache, where a
short cache means more decode steps, each no slower."""

from __future__ import annotations

import attrs
import pytest
import torch

from rlcore.planning.calibration import Calibration
from rlcore.planning.hardware import Cluster, gpu
from rlcore.planning.layout import Layout, Workload
from rlcore.planning.memory import activation_bytes_per_token_layer, estimate
from rlcore.planning.shapes import from_hf_config
from rlcore.planning.timing import generation_s

SMALL_LLAMA = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "vocab_size": 512, "tie_word_embeddings": True, "model_type": "llama",
               "architectures": ["LlamaForCausalLM"]}


def _saved_bytes(layers: int, tokens: int) -> int:
    """Bytes of the distinct storages autograd saves in a bf16 forward of a ``layers``-layer Llama (weights excluded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in SMALL_LLAMA.items() if k not in ("model_type", "architectures")},
                      num_hidden_layers=layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, SMALL_LLAMA["vocab_size"], (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False)
    return sum(n for ptr, n in saved.items() if ptr not in weights)


def test_an_eager_hugging_face_layer_keeps_what_the_fsdp2_count_says():
    tokens = 128
    per_layer = (_saved_bytes(2, tokens) - _saved_bytes(1, tokens)) / tokens  # one more layer, per token
    shape = from_hf_config("small", {**SMALL_LLAMA, "num_hidden_layers": 2})
    counted = activation_bytes_per_token_layer(shape, Layout(backend="fsdp2"), eager=True)
    # the count leaves out per-token scalars (each norm's float32 rsqrt): 136 bytes of a layer's 13.8k
    assert counted == pytest.approx(per_layer, rel=0.02)
    # and it keeps more than Megatron's fused layers, whose count the compiled model takes
    assert counted > 1.3 * activation_bytes_per_token_layer(shape, Layout(backend="fsdp2"), eager=False)


def test_a_short_paged_kv_cache_takes_more_decode_steps_each_no_slower():
    shape = from_hf_config("llama", {**SMALL_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "num_hidden_layers": 32})
    work = Workload(samples=256, prompt_tokens=16, response_tokens=1024, max_seq=1088)
    cluster, cal = Cluster(gpu("h100"), 1, 1), Calibration()
    lay = Layout(gen_memory_fraction=0.9)
    full = estimate(shape, work, lay, cluster, cal)
    kv_token = 2 * shape.layers * shape.kv_dim * 2
    # a cache of C tokens: sequences hold blocks for the tokens they have so far, p + r/2 on average over their lives
    half = attrs.evolve(full, engine_kv_gib=64 * (16 + 512) * kv_token / 2**30)
    seconds_full, concurrent_full = generation_s(shape, work, lay, cluster, cal, full)
    seconds_half, concurrent_half = generation_s(shape, work, lay, cluster, cal, half)
    assert concurrent_full == 256 and concurrent_half == 64
    steps_full, steps_half = 1024, 256 * 1024 // 64
    assert seconds_half > seconds_full
    assert seconds_half / steps_half <= seconds_full / steps_full  # four times the steps, none slower
