"""LoRA GRPO through the real loop (``rlcore.run``): the fsdp2 backend with ``policy.lora`` trains,
each refit sends the merged weights into the session's vLLM engine, and the loop's refit probe
finds vLLM's logprobs equal to the trainer's. Only the adapters change; the base weights stay
bit-identical. (The engine is the session one: no extra engine start.)"""

from __future__ import annotations

import pytest
import torch

from rlcore.interfaces import EnvStep, Sample

from _vllm_helpers import hf_token_logprobs, state_dict_trainer

pytestmark = pytest.mark.vllm

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
