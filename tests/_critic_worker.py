"""One rank of the 2-process critic checks (launched by test_critic_parity.py).

Usage: python _critic_worker.py RANK WORLD PORT VALUE_MODEL OUT_DIR. Builds each backend's critic
through its registered factory, in several layouts, and records on rank 0: the values of a batch,
one ``train`` on the clipped value loss (its metrics) and the weights after it (Hugging Face
names). The test compares them with a single-process float64 reference.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

MB_TOKENS = 20  # several packed micro-batches per rank: accumulation and packing are exercised
LR, EPS, MAX_GRAD_NORM = 1e-3, 1e-6, 1.0


def make_batch(n: int = 7, vocab: int = 128, seed: int = 3):
    """Random sequences (prompt: the first third, masked) with old values and returns near the
    head's outputs, so that the value clip binds on some tokens and not on others."""
    from rlcore.interfaces import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    ids, masks, old, returns = [], [], [], []
    for _ in range(n):
        length = int(torch.randint(5, 20, (1,), generator=g))
        ids.append(torch.randint(3, vocab, (length,), generator=g))
        mask = torch.ones(length)
        mask[: max(1, length // 3)] = 0
        masks.append(mask)
        old.append(0.3 * torch.randn(length, generator=g))
        returns.append(torch.randn(length, generator=g))
    return SequenceBatch(input_ids=ids, loss_mask=masks, token_fields={"values": old, "returns": returns})


def run_config(path: str):
    from rlcore.config import RunConfig
    from rlcore.config.schema import OptimizerConfig, PolicyConfig, SequencePackingConfig

    policy = PolicyConfig(model_name=path, precision="float32", max_grad_norm=MAX_GRAD_NORM,
                          optimizer=OptimizerConfig(lr=LR, weight_decay=0.0, eps=EPS),
                          sequence_packing=SequencePackingConfig(train_mb_tokens=MB_TOKENS, logprob_mb_tokens=MB_TOKENS))
    return RunConfig(policy=policy)


def exported(critic) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().clone() for chunk in critic.export_weights(chunk_bytes=1 << 16) for n, t in chunk}


def scenario(backend: str, path: str, **layout) -> dict:
    from rlcore.algorithms.value_loss import ValueLoss
    from rlcore.interfaces import WorldInfo
    from rlcore.plugins import get_plugin_manager
    from rlcore.utils import resolve

    reg = get_plugin_manager().get("training_backend", backend)
    section = reg.config_cls(enabled=True, **layout)
    world = WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size())
    critic = resolve(reg.capabilities["critic"])(run_config(path), section, world)
    batch = make_batch()
    values = critic.values(batch)
    metrics = critic.train(batch, ValueLoss(0.2))
    weights = exported(critic)
    after = critic.values(batch)
    critic.shutdown()
    return {"values": values, "metrics": metrics, "weights": weights, "values_after": after}


SCENARIOS = {
    "fsdp2_dp2": ("fsdp2", {}),
    "megatron_dp2": ("megatron", {}),
    "megatron_tp2_sp": ("megatron", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "megatron_pp2": ("megatron", {"pipeline_model_parallel_size": 2}),
    "megatron_cp2": ("megatron", {"context_parallel_size": 2}),
}


def main(rank: int, world: int, port: str, path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name, (backend, layout) in SCENARIOS.items():
        try:
            results[name] = scenario(backend, path, **layout)
        except Exception:  # noqa: BLE001 - recorded; the test names the scenario and shows it
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if rank == 0:
        torch.save(results, os.path.join(out, "critic.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads, see core/tests/test_invariance.py)
