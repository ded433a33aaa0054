"""The built-in hf generator decodes a whole batch at once with the results of decoding each row alone."""

from __future__ import annotations

import pytest

from rlcore.interfaces import SamplingParams


@pytest.fixture(scope="module")
def generator(tiny_model_dir):
    from rlcore.loading.loader import build_config
    from rlcore.generation.hf_generator import HFGenerator

    config = build_config({"policy": {"model_name": str(tiny_model_dir), "generation": {"backend": "hf"}}})
    return HFGenerator(str(tiny_model_dir), config.section("policy.generation"), 64)


def _prompts(generator):
    return [generator.tokenizer.encode(text, add_special_tokens=False) for text in ("1+2=", "33+44=", "5+678=", "9=")]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_rows_equal_rows_decoded_alone(generator, temperature):
    """Prompts of different lengths (left padding), greedy and sampled with per-row seeds."""
    params = SamplingParams(n=3, max_new_tokens=6, temperature=temperature, seed=11, ignore_eos=False)
    prompts = _prompts(generator)
    batched = generator.generate(prompts, params)
    for p, prompt in enumerate(prompts):
        for k in range(params.n):
            alone = generator._sample_one(prompt, params, 11 + 1_000_003 * p + k)
            got = batched[p][k]
            assert got.prompt_ids == prompt and got.response_ids == alone.response_ids
            assert got.response_logprobs == pytest.approx(alone.response_logprobs, abs=1e-5)
            assert got.finish_reason == alone.finish_reason
    assert generator.generate(prompts, params) == batched  # seeded: the run repeats
    if temperature > 0:  # different seeds draw different samples
        assert len({tuple(r.response_ids) for r in batched[0]}) > 1


def test_budget_and_stop_per_row(generator):
    """Each row stops at its own budget (the model length limit) or stop string; finished rows stay finished."""
    prompts = _prompts(generator) + [list(range(3, 3 + 61))]  # 61 tokens: room for 3 new ones in 64
    params = SamplingParams(n=1, max_new_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    results = [r[0] for r in generator.generate(prompts, params)]
    assert [len(r.response_ids) for r in results] == [10, 10, 10, 10, 3]
    assert all(r.finish_reason == "length" for r in results)
    first = generator.tokenizer.decode(results[0].response_ids[:2])
    stopped = generator.generate(prompts[:1], SamplingParams(n=1, max_new_tokens=10, temperature=1.0, seed=3,
                                                             ignore_eos=True, stop=(first,)))[0][0]
    n = len(stopped.response_ids)
    assert stopped.finish_reason == "stop" and n <= 2 and stopped.response_ids == results[0].response_ids[:n]
    assert generator.tokenizer.decode(stopped.response_ids).endswith(first)


def test_refit_of_checkpoint_named_moe_experts_loads_the_fused_parameters(tiny_model_factory):
    # Refits stream checkpoint names (per-expert gate/up/down, as vLLM loads them); transformers keeps
    # MoE experts fused in memory. Every expert weight must land in its slice of the fused tensors.
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from rlcore.config.hf_generation import HFGenerationConfig
    from rlcore.generation.hf_generator import HFGenerator

    path = tiny_model_factory("qwen3_moe", hidden_size=256, num_heads=4, num_kv_heads=2)
    generator = HFGenerator(str(path), HFGenerationConfig(), 64)
    other = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn_like(param))
    named = revert_weight_conversion(other, dict(other.state_dict()))
    assert any(".experts.3.gate_proj." in name for name in named)
    generator.update_weights([list(named.items())])
    mine, theirs = generator.model.state_dict(), other.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_registered_generator_runs_on_the_runs_device_and_scores_what_it_samples(tiny_model_dir, device):
    """build() puts the model on the placement's device (a GPU run's colocated GPU); the tokens it
    samples there score, through its own forward, to the logprobs it reported."""
    import torch

    from rlcore.loading.loader import build_config
    from rlcore.generation.hf_generator import build
    from rlcore.interfaces import Placement

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    config = build_config({"policy": {"model_name": str(tiny_model_dir), "max_total_sequence_length": 64,
                                      "generation": {"backend": "hf"}}})
    gen = build(config, config.section("policy.generation"), Placement(device=device))
    assert next(gen.model.parameters()).device.type == device
    (results,) = gen.generate([gen.tokenizer.encode("1+2=", add_special_tokens=False)],
                              SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=3, ignore_eos=True))
    for r in results:
        scored = gen.score([r.prompt_ids + r.response_ids])[0][-len(r.response_ids):]
        # float32 forward of a tiny model, batch of one against batch of two: rounding only
        assert scored == pytest.approx(r.response_logprobs, abs=1e-4)
