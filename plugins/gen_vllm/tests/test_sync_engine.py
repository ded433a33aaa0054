"""The sync engine (``vllm.LLM``): conformance, logprob parity with Hugging Face, colocated refit,
prompt overflow; a model written by ``rlcore export`` generating in it as in ``transformers``; LoRA
GRPO through the real loop refitting into it. All tests share one engine (session fixture), in one
file so that one pytest-xdist worker (``--dist loadfile``) starts it."""

from __future__ import annotations

import attrs
import pytest
import torch
import yaml

from rlcore.interfaces import EnvStep, Sample, SamplingParams
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


# ---- a model written by rlcore export --------------------------------------------------------------
# The model of an fsdp2 run checkpoint, exported, generates in the engine exactly as transformers does with
# the exported directory: its Hugging Face names and layouts are what vLLM loads.
@pytest.fixture
def exported_dir(vllm_model_dir, tmp_path, single_process_group):
    """One fsdp2 training step from the engine's model, saved as a run checkpoint, then exported."""
    pytest.importorskip("rlcore_fsdp2", reason="the checkpoint is written by the FSDP2 backend (rlcore-fsdp2)")
    from rlcore import build_config
    from rlcore.runtime import CheckpointManager, to_dict
    from rlcore.runtime import export_checkpoint
    from rlcore.interfaces import SequenceBatch, WorldInfo
    from rlcore.plugins import get_plugin_manager
    from rlcore_fsdp2.backend import FSDP2Backend

    run_dir = tmp_path / "run"
    config = build_config({"policy": {"model_name": str(vllm_model_dir), "precision": "float32", "max_grad_norm": None,
                                      "optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True}},
                           "logger": {"log_dir": str(run_dir)}})
    backend = FSDP2Backend(config, config.section("policy.dtensor_cfg"), WorldInfo(0, 1))
    ids = [torch.arange(3, 23), torch.arange(30, 42)]
    backend.train(SequenceBatch(input_ids=ids, loss_mask=[torch.ones(len(t)) for t in ids]),
                  get_plugin_manager().get("algorithm", "sft").build(None))
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config)))
    CheckpointManager(run_dir / "checkpoints", 1).save(1, backend.save_checkpoint, {"step": 1, "run": {"log_dir": str(run_dir)}})
    backend.shutdown()
    export_checkpoint(run_dir, tmp_path / "exported")
    return tmp_path / "exported"


def test_an_exported_checkpoint_generates_in_vllm_like_transformers(sync_generator, hf_model, exported_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlcore.plugins import get_plugin_manager

    exported = load_file(str(exported_dir / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(exported_dir, dtype=torch.float32).eval()
    assert max(float((exported[k] - v).abs().max()) for k, v in hf_model.state_dict().items() if k in exported) > 1e-3
    transport = get_plugin_manager().weight_transport(trainer=state_dict_trainer(exported), generator=sync_generator)
    prompts = [[5, 6, 7, 8, 9], [3, 40, 41, 42]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    try:
        transport.transfer(state_dict_trainer(exported), sync_generator)
        got = [r[0].response_ids for r in sync_generator.generate(prompts, greedy)]
        assert got == [hf_greedy(reference, p, 12) for p in prompts]
        seq = prompts[0] + got[0]
        assert (torch.tensor(sync_generator.score([seq])[0]) - hf_token_logprobs(reference, seq)).abs().max().item() < 1e-3
    finally:
        transport.transfer(state_dict_trainer(dict(hf_model.state_dict())), sync_generator)


# ---- LoRA GRPO through the loop --------------------------------------------------------------------
# The fsdp2 backend with policy.lora trains, each refit sends the merged weights into the engine, and the
# loop's refit probe finds vLLM's logprobs equal to the trainer's. Only the adapters change; the base
# weights stay bit-identical.
PROBE_THRESHOLD = 1e-3


class OddCharacters:
    """Reward: the share of the response's characters whose code point is odd. A random model's
    samples differ in it, so every group has nonzero advantages and GRPO moves the adapters."""

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        return [EnvStep(reward=sum(ord(c) % 2 for c in h[-1]) / max(1, len(h[-1]))) for h in histories]


class Prompts:
    def __init__(self, count: int = 16):
        self.train = [Sample(prompt="", prompt_ids=[3, 10 + i, 20 + i, 30 + i], index=i) for i in range(count)]
        self.validation = None


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def test_lora_grpo_steps_train_only_the_adapters_and_each_refit_passes_the_probe(
        sync_generator, hf_model, vllm_model_dir, tmp_path, single_process_group):
    pytest.importorskip("rlcore_fsdp2", reason="LoRA training is the FSDP2 backend's (rlcore-fsdp2)")
    pytest.importorskip("peft")
    import rlcore
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend

    config = rlcore.build_config({
        "policy": {"model_name": str(vllm_model_dir), "precision": "float32", "max_total_sequence_length": 32,
                   "optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True},
                   "lora": {"enabled": True, "rank": 4, "alpha": 8},
                   "generation": {"backend": "vllm", "max_new_tokens": 4, "temperature": 1.0,
                                  "refit": {"probe_threshold": PROBE_THRESHOLD}}},
        "algorithm": {"name": "grpo"},
        "train": {"num_prompts_per_step": 4, "max_num_steps": 2, "seed": 0},
        "grpo": {"num_generations_per_prompt": 4},
        "logger": {"log_dir": str(tmp_path / "run"), "print_table": False, "plot": False},
    })
    backend = FSDP2Backend(config, config.section("policy.dtensor_cfg"), WorldInfo(0, 1))
    model = backend.model  # kept: the run's shutdown drops the backend's reference
    before = {name: _full(p) for name, p in model.named_parameters()}
    try:
        result = rlcore.run(config, backend=backend, generator=sync_generator, dataset=Prompts(),
                            environment=OddCharacters())
        steps = [r for r in result["records"] if r.get("step", 0) >= 1]
        assert [r["step"] for r in steps] == [1, 2]
        for record in steps:  # the loop raises past the threshold; the records carry the gap of every refit
            assert record["refit/probe_mean_abs_logprob_diff"] < PROBE_THRESHOLD
            assert record["refit/probe_max_abs_logprob_diff"] < 10 * PROBE_THRESHOLD
        after = {name: _full(p) for name, p in model.named_parameters()}
        changed = {name for name in before if not torch.equal(before[name], after[name])}
        assert changed and all(".lora_A." in n or ".lora_B." in n for n in changed), sorted(changed)[:5]
        assert any(".lora_B." in n for n in changed)  # B starts at zero: the merged update is nonzero
        # the engine now holds the trained policy, not the base model: the probe compared real updates
        seq = [3, 10, 20, 30, 11, 21, 31, 12]
        moved = (torch.tensor(sync_generator.score([seq])[0]) - hf_token_logprobs(hf_model, seq)).abs().max().item()
        assert moved > 10 * PROBE_THRESHOLD
    finally:
        from rlcore.plugins import get_plugin_manager

        base = state_dict_trainer(dict(hf_model.state_dict()))
        get_plugin_manager().weight_transport(trainer=base, generator=sync_generator).transfer(base, sync_generator)
