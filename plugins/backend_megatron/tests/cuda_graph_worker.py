"""One rank of the CUDA-graph path's CPU checks (launched by test_cuda_graph.py, 2 ranks, gloo).

Usage: python cuda_graph_worker.py RANK WORLD PORT MODEL_DIR MOE_MODEL_DIR OUT_DIR. For DP=2 and TP=2 + SP, two
backends from the same checkpoint train the same batches: ``cuda_graph: none`` (the schedule) and
``cuda_graph: micro_batch`` without capture (the graphs' padded static buffers, called directly).
Writes ``OUT_DIR/rank_<r>.json``: the largest differences (:func:`rel`) of logprobs, loss, metrics,
gradient norm and weights, how many buckets served micro-batches of different lengths, and the refusals' messages.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The CPU path's check, on a GPU machine too: with a GPU visible, Megatron places its rotary tables and norms there
# beside the CPU model (the capture and replay on the GPU are test_megatron_cuda.py's); with Transformer Engine
# installed, Megatron's optimizer takes TE's CUDA multi-tensor kernels for the gradient norm, even of CPU tensors.
# So the worker sees what a CPU machine has: no GPU, no Transformer Engine (Megatron falls back to torch's).
# Only as a script: test_megatron_cuda.py imports this module's helpers into a process that uses both.
if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.modules["transformer_engine"] = None  # type: ignore[assignment]  # its import now fails as where it is absent

import torch  # noqa: E402
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import record  # noqa: E402


def make_batch(seed: int, n: int, vocab: int = 100):
    """GRPO inputs with sequence-level advantages and old / reference / generator logprobs."""
    from rlcore.interfaces import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    ids, masks, old, ref, gen = [], [], [], [], []
    for _ in range(n):
        length = int(torch.randint(5, 30, (1,), generator=g))
        ids.append(torch.randint(3, vocab, (length,), generator=g))
        mask = torch.ones(length)
        mask[: max(1, length // 3)] = 0
        masks.append(mask)
        base = -torch.rand(length, generator=g) * 4
        old.append(base)
        ref.append(base + 0.1 * torch.randn(length, generator=g))
        gen.append(base + 0.2 * torch.randn(length, generator=g))
    return SequenceBatch(input_ids=ids, loss_mask=masks, token_fields={"old_logprobs": old, "ref_logprobs": ref, "gen_logprobs": gen},
                         seq_fields={"advantages": torch.randn(n, generator=g)})


def recording(algorithm_cls):
    """``algorithm_cls`` whose loss keeps (ids, mask, logprobs) of every micro-batch it sees (eager only)."""

    class Recording(algorithm_cls):
        seen: list

        def loss(self, logprobs_T, mb, totals):
            self.seen.append((mb.input_ids_T.clone(), mb.loss_mask_T.clone(), logprobs_T.detach().clone()))
            return super().loss(logprobs_T, mb, totals)

    return Recording


def algorithm():
    from rlcore.algorithms.config import GRPOConfig, RolloutCorrectionConfig
    from rlcore.algorithms.grpo import GRPO

    algo = recording(GRPO)(GRPOConfig(kl_coef=0.05, use_old_logprobs=True, ratio_clip_c=3.0,
                                      rollout_correction=RolloutCorrectionConfig(preset="token_tis", cap=1.2)))
    algo.seen = []
    return algo


def backend_for(path: str, **mcfg):
    from rlcore.config import RunConfig
    from rlcore.config.schema import PolicyConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.config import MegatronConfig, MegatronOptimizerConfig

    policy = PolicyConfig(model_name=path, precision="float32",
                          sequence_packing=SequencePackingConfig(train_mb_tokens=48, logprob_mb_tokens=48))
    # SGD: Adam's first step is lr * g / (|g| + eps), which turns rounding-level gradient differences into lr-sized ones
    opt = MegatronOptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.0, use_distributed_optimizer=False, clip_grad=0.0)
    capture = mcfg.pop("cuda_graph_capture", False)
    return MegatronBackend(RunConfig(policy=policy), MegatronConfig(enabled=True, optimizer=opt, **mcfg),
                           WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size()), cuda_graph_capture=capture)


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| / max(|a|, 1): absolute below 1, relative above (logprobs near -5 differ by fp32 ulps of 5).

    The paths are not bitwise equal on CPU: the exact attention there batches similar-length
    sequences or runs them one by one depending on the segment lengths, padding segment included,
    and the two differ by rounding (with one-by-one attention forced, the hidden states are equal)."""
    return (a.double() - b.double()).abs() / a.double().abs().clamp(min=1.0)


def weights(backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.module.named_parameters()}


def compare(path: str, **mcfg) -> dict:
    """Two steps on batches of other lengths: the graph path against the schedule."""
    runs = {}
    for mode in ("none", "micro_batch"):
        backend, algo = backend_for(path, cuda_graph=mode, **mcfg), algorithm()
        metrics = [backend.train(make_batch(seed, n=9), algo) for seed in (3, 4)]
        shared = graphs_shared(backend.graphs) if backend.graphs is not None else None
        runs[mode] = (metrics, weights(backend), algo.seen, shared)
        initial = dict(backend._reference)
        backend.shutdown()
    (m_a, w_a, seen_a, _), (m_b, w_b, seen_b, shared) = runs["none"], runs["micro_batch"]
    lp_diff = 0.0
    for (ids_a, mask_a, lp_a), (ids_b, mask_b, lp_b) in zip(seen_a, seen_b, strict=True):
        t = ids_a.numel()
        assert torch.equal(ids_a, ids_b[:t]) and torch.equal(mask_a, mask_b[:t]) and not mask_b[t:].any()
        on = mask_a > 0
        if on.any():
            lp_diff = max(lp_diff, float(rel(lp_a[on], lp_b[:t][on]).max()))
    keys = sorted(set(m_a[0]) - {"train_seconds"})
    metric_diff = max(float(rel(torch.tensor(a[k]), torch.tensor(b[k]))) for a, b in zip(m_a, m_b) for k in keys)
    return {"logprobs": lp_diff, "loss": max(float(rel(torch.tensor(a["loss"]), torch.tensor(b["loss"]))) for a, b in zip(m_a, m_b)),
            "metrics": metric_diff, "metric_keys": keys, "missing_metrics": sorted(set(m_a[0]) ^ set(m_b[0])),
            "grad_norm": max(float(rel(torch.tensor(a["grad_norm"]), torch.tensor(b["grad_norm"]))) for a, b in zip(m_a, m_b)),
            "weights": max(float((w_a[k] - w_b[k]).abs().max()) for k in w_a),
            "moved": max(float((w_a[k] - initial[k]).abs().max()) for k in w_a),
            "loss_value": m_a[0]["loss"], "micro_batches": len(seen_b),
            "shared_buckets": shared}


def graphs_shared(graphs) -> int:
    """Buckets whose static buffers served micro-batches of different real lengths."""
    return sum(1 for lengths in graphs.lengths_seen.values() if len(lengths) > 1)


def refusals(path: str, moe_path: str) -> dict:
    from rlcore.algorithms.config import DPOConfig
    from rlcore.algorithms.dpo import DPO
    from rlcore.config import ConfigError

    out = {}
    cases = {"cpu_capture": lambda: backend_for(path, cuda_graph="micro_batch", cuda_graph_capture=True),
             "moe": lambda: backend_for(moe_path, cuda_graph="micro_batch")}
    for name, build in cases.items():
        try:
            build().shutdown()
            out[name] = "built"
        except ConfigError as err:
            out[name] = str(err)
    backend = backend_for(path, cuda_graph="micro_batch")
    try:
        batch = make_batch(5, n=4)
        batch.seq_fields["pack_group"] = torch.tensor([0, 0, 1, 1])
        batch.seq_fields["chosen"] = torch.tensor([1.0, 0.0, 1.0, 0.0])
        backend.train(batch, DPO(DPOConfig()))
        out["dpo"] = "trained"
    except ConfigError as err:
        out["dpo"] = str(err)
    backend.shutdown()
    return out


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    path, moe_path, tmp = sys.argv[4], sys.argv[5], Path(sys.argv[6])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    for name, fn in (("dp2", lambda: compare(path)), ("tp2_sp", lambda: compare(path, tensor_model_parallel_size=2, sequence_parallel=True)),
                     ("refusals", lambda: refusals(path, moe_path))):
        record(out, name, fn)
    (tmp / f"rank_{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
