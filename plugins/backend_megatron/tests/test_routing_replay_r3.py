"""Routing replay R3 (``moe_router_replay: r3``) on CPU, one process: the trainer routes every token
to the experts the generator reported for it (``SequenceBatch.routed_experts``), in the step's
old-logprob pass and in both optimizer steps of a training call, and the mismatch fraction counts
how often its own routing differs. The routing here is drawn at random, far from what the router
would choose, so replay that silently fell back to the router's own choice fails. vLLM's half
(``return_routed_experts``) needs CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import SumNLL, make_batch  # noqa: E402
from routing_replay_worker import RouterWatch  # noqa: E402

from rlcore.config import ConfigError, GenerationConfig  # noqa: E402


def r3_backend(path: str, generation: GenerationConfig):
    from rlcore.config import RunConfig
    from rlcore.config.schema import PolicyConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import build_backend
    from rlcore_megatron.config import MegatronConfig, MegatronOptimizerConfig

    policy = PolicyConfig(model_name=path, precision="float32", train_global_batch_size=4,
                          sequence_packing=SequencePackingConfig(train_mb_tokens=40, logprob_mb_tokens=64))
    cfg = MegatronConfig(enabled=True, moe_router_replay="r3",
                         optimizer=MegatronOptimizerConfig(lr=0.05, weight_decay=0.0, adam_eps=1e-6))
    return build_backend(RunConfig(policy=policy, sections={"policy.generation": generation}), cfg, WorldInfo())


def random_routing(batch, num_layers: int, num_experts: int, topk: int, seed: int = 0) -> list[torch.Tensor]:
    """[len, layers, k] distinct experts per (token, layer); the last row unreported (-1), as vLLM's."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for ids in batch.input_ids:
        experts = torch.stack([torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(num_layers)])
                               for _ in range(ids.numel())]).to(torch.int16)
        experts[-1] = -1
        out.append(experts)
    return out


@pytest.fixture(scope="module")
def moe_path(tiny_model_factory):
    return str(tiny_model_factory("qwen3_moe"))


def test_r3_trains_every_token_with_the_generators_experts(single_process_group, moe_path):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(moe_path)
    backend = r3_backend(moe_path, GenerationConfig(return_routed_experts=True))
    watch = RouterWatch(backend)
    batch = make_batch(11, n=8)
    batch.routed_experts = random_routing(batch, hf.num_hidden_layers, hf.num_experts, hf.num_experts_per_tok)
    policy = backend.run.policy
    given = {(ids.numpy().tobytes(), pos, layer): tuple(sorted(experts[pos, layer].tolist()))
             for ids, experts in zip(batch.input_ids, batch.routed_experts)
             for pos in range(ids.numel() - 1) for layer in range(hf.num_hidden_layers)}
    # The old-logprob pass replays the generator's routing too, so the PPO ratio compares one network.
    old_lp = backend.logprobs(batch)
    lp_mbs = backend.micro_batches(batch, policy.sequence_packing.logprob_mb_tokens, policy.logprob_batch_size)
    used_by_old = watch.sets(lp_mbs, 1)
    assert all(s == given[key] for key, sets in used_by_old.items() if key in given for s in sets)
    assert sum(key in given for key in used_by_old) == len(given)
    unrouted = batch.select(range(len(batch)))
    unrouted.routed_experts = None  # as the refit probe's sequences: the router's own choice
    watch.calls = []
    own_lp = backend.logprobs(unrouted)
    assert max((a - b).abs().max().item() for a, b in zip(old_lp, own_lp)) > 1e-3
    watch.calls = []
    metrics = backend.train(batch, SumNLL())
    train_mbs = [mb for start in (0, 4) for mb in backend.micro_batches(batch.select(range(start, start + 4)),
                                                                          policy.sequence_packing.train_mb_tokens, 4)]
    used = watch.sets(train_mbs, 1)
    checked = [(key, sets) for key, sets in used.items() if key in given]
    backend.shutdown()
    assert len(checked) == len(given)  # every reported (token, layer) was trained on
    assert all(s == given[key] for key, sets in checked for s in sets)  # one token routed otherwise fails this
    assert metrics["num_optimizer_steps"] == 2.0
    assert metrics["moe/routing_mismatch_fraction"] > 0.3  # random experts: the router's own choice mostly differs


def test_r3_needs_a_generator_that_reports_routing(single_process_group, moe_path):
    with pytest.raises(ConfigError, match=r"moe_router_replay.*'r3'.*return_routed_experts: true"):
        r3_backend(moe_path, GenerationConfig())
    backend = r3_backend(moe_path, GenerationConfig(return_routed_experts=True))
    batch = make_batch(3, n=4)  # routed_experts None: e.g. multi-turn rollouts, which carry none
    with pytest.raises(ConfigError, match=r"'r3' replays the generator's routing, and this batch has none"):
        backend.train(batch, SumNLL())
    backend.shutdown()
