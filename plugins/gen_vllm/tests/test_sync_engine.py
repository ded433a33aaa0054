"""The sync engine (``vllm.LLM``): conformance, logprob parity with Hugging Face, colocated refit,
prompt overflow. All tests share one engine (session fixture)."""

from __future__ import annotations

import attrs
import pytest
import torch

from rlcore.interfaces import SamplingParams
from rlcore.testing.conformance import GeneratorConformance

from _vllm_helpers import hf_greedy, hf_token_logprobs, perturbed_state_dict, state_dict_trainer, with_weights

pytestmark = pytest.mark.vllm


class TestSyncConformance(GeneratorConformance):
    @pytest.fixture
    def generator(self, sync_generator):
        return sync_generator

    @pytest.fixture
    def generator_model_dir(self, vllm_model_dir):
        return vllm_model_dir


def _prompts(tokenizer):
    texts = ["12+35=", "What is 7*6?", "hello", "(3+4)*2 ="]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          return_dict=False) for t in texts]


def test_sampled_logprobs_match_a_hugging_face_forward(sync_generator, hf_model):
    prompts = _prompts(sync_generator.tokenizer)
    results = sync_generator.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=3))
    worst = 0.0
    for prompt, per_prompt in zip(prompts, results):
        assert len(per_prompt) == 2
        for r in per_prompt:
            assert r.prompt_ids == prompt and len(r.response_ids) >= 1
            ref = hf_token_logprobs(hf_model, r.prompt_ids + r.response_ids)[len(prompt):]
            worst = max(worst, (ref - torch.tensor(r.response_logprobs)).abs().max().item())
    assert worst < 1e-3, f"vLLM sampling logprobs differ from HF by {worst}"


def test_colocated_refit_then_greedy_equals_hf_greedy_with_the_new_weights(sync_generator, hf_model):
    from rlcore.plugins import get_plugin_manager
    from rlcore_vllm.transport import ColocatedTransport

    new_weights = perturbed_state_dict(hf_model, seed=11)
    transport = get_plugin_manager().weight_transport(trainer=state_dict_trainer(new_weights), generator=sync_generator)
    assert isinstance(transport, ColocatedTransport)
    assert sync_generator.encoding_for(torch.zeros(1)) == "shm"  # the engine core is another process
    version = sync_generator.weights_version
    prompts = _prompts(sync_generator.tokenizer)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    before = [r[0].response_ids for r in sync_generator.generate(prompts, greedy)]
    try:
        moved = transport.transfer(state_dict_trainer(new_weights), sync_generator)
        assert moved["bytes"] == sum(t.numel() * 4 for t in new_weights.values()) and moved["seconds"] > 0
        assert sync_generator.weights_version == version + 1
        reference = with_weights(hf_model, new_weights)
        after = [r[0].response_ids for r in sync_generator.generate(prompts, greedy)]
        assert after == [hf_greedy(reference, p, 16) for p in prompts]
        assert after != before, "the perturbation should change greedy outputs"
        seq = prompts[0] + after[0]
        diff = (torch.tensor(sync_generator.score([seq])[0]) - hf_token_logprobs(reference, seq)).abs().max().item()
        assert diff < 1e-3
    finally:
        transport.transfer(state_dict_trainer(dict(hf_model.state_dict())), sync_generator)
    assert [r[0].response_ids for r in sync_generator.generate(prompts, greedy)] == before


def test_prompt_overflow_truncates_or_drops_and_counts(sync_generator):
    from rlcore_vllm.config import VllmConfig  # noqa: F401 - the schema under test

    limit = sync_generator.max_model_len
    long_prompt = list(range(3, 60)) * 5  # > max_model_len tokens
    assert len(long_prompt) > limit
    short = [5, 6, 7]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = sync_generator.metrics()
    results = sync_generator.generate([long_prompt, short], params)
    assert results[0][0].prompt_ids == long_prompt[-(limit - 1):]
    assert 1 <= len(results[0][0].response_ids) <= 1 + 0  # only one position was left in the context
    assert len(results[1][0].response_ids) == 8
    after = sync_generator.metrics()
    assert after["generation/truncated_prompts"] == before["generation/truncated_prompts"] + 1

    config = sync_generator.config
    sync_generator.config = attrs.evolve(config, prompt_overflow="drop")
    try:
        results = sync_generator.generate([long_prompt, short], attrs.evolve(params, n=2))
    finally:
        sync_generator.config = config
    assert [r.finish_reason for r in results[0]] == ["truncated_prompt"] * 2
    assert all(r.response_ids == [] and r.prompt_ids == long_prompt for r in results[0])
    assert [len(r.response_ids) for r in results[1]] == [8, 8]
    assert sync_generator.metrics()["generation/dropped_prompts"] == before["generation/dropped_prompts"] + 1


def test_asleep_generator_refuses_to_generate(sync_generator):
    sync_generator.sleep()
    try:
        with pytest.raises(RuntimeError, match="asleep"):
            sync_generator.generate([[5, 6]], SamplingParams(max_new_tokens=2))
    finally:
        sync_generator.wake_up()
    assert len(sync_generator.generate([[5, 6]], SamplingParams(max_new_tokens=2))[0][0].response_ids) >= 1


def test_batched_decode_gives_the_engines_text_and_logprobs(sync_generator):
    """Responses decoded once per response (default) equal vLLM's per-token detokenization."""
    prompts = _prompts(sync_generator.tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=5, ignore_eos=True)
    original = sync_generator.config
    try:
        batched = sync_generator.generate(prompts, params)
        sync_generator.config = attrs.evolve(original, experimental=attrs.evolve(original.experimental, engine_detokenize=True))
        engine = sync_generator.generate(prompts, params)
    finally:
        sync_generator.config = original
    pairs = [(a, b) for per_a, per_b in zip(batched, engine) for a, b in zip(per_a, per_b)]
    assert all(a.response_ids == b.response_ids for a, b in pairs)  # same seed, same samples
    assert any(b.text for _, b in pairs)
    assert [a.text for a, _ in pairs] == [b.text for _, b in pairs]
    # Two engine passes over the same samples: their fp32 logprobs may differ in the last bits (an ulp is
    # 4.8e-7 at |logp| 4-8; a batch of another shape reorders the hidden-size sums): 1e-5 is ~20 ulps
    for a, b in pairs:
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-5)
