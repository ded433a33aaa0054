"""One rank of the 2-process gloo routing-replay checks (launched by test_routing_replay.py).

Usage: python routing_replay_worker.py RANK WORLD PORT MODEL_DIR OUT_DIR. Every scenario builds a
tiny Qwen3-MoE backend, runs the old-logprob pass and a training call of two optimizer steps (so
the second step's micro-batches meet weights the logprob pass never saw), and watches every
router's output (its routing map) through forward hooks. Rows are mapped to tokens here with the
micro-batch layout (and ``context_parallel.layout`` under CP), independently of the backend's
replay code, and each token's expert set in the training pass is compared with the one it got in
the logprob pass. Writes ``OUT_DIR/rank_<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import SumNLL, make_batch, record  # noqa: E402


def backend_for(path: str, *, device: str = "cpu", precision: str = "float32", **mcfg):
    from rlcore.config import RunConfig
    from rlcore.config.schema import PolicyConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import build_backend
    from rlcore_megatron.config import MegatronConfig, MegatronOptimizerConfig

    # Logprob and training micro-batches differ (64 vs 40 tokens), and two optimizer steps per call.
    policy = PolicyConfig(model_name=path, precision=precision, train_global_batch_size=4,
                          sequence_packing=SequencePackingConfig(train_mb_tokens=40, logprob_mb_tokens=64))
    # A large learning rate so that the first optimizer step moves router logits past top-k boundaries.
    cfg = MegatronConfig(enabled=True, optimizer=MegatronOptimizerConfig(lr=0.05, weight_decay=0.0, adam_eps=1e-6), **mcfg)
    world = WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
    return build_backend(RunConfig(policy=policy), cfg, world)


class RouterWatch:
    """Every router call's chosen expert sets, per token (sequence ids bytes, position, layer)."""

    def __init__(self, backend):
        self.backend = backend
        self.routers = [m for m in backend.module.modules() if getattr(m, "router_replay", None) is not None]
        self.calls: list[tuple[int, torch.Tensor]] = []
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(lambda mod, args, out, layer=layer: self.calls.append((layer, out[1].detach().clone())))

    def tokens(self, mbs) -> list[list[tuple[bytes, int] | None]]:
        """For each micro-batch, the token of each row this rank's routers see (None: padding)."""
        from megatron.core import parallel_state as mpu
        from rlcore_megatron import context_parallel

        out = []
        for mb in mbs:
            cu = mb.cu_seqlens.tolist()
            keys = [mb.input_ids_T[a:b].numpy().tobytes() for a, b in zip(cu[:-1], cu[1:])]
            stream = [(keys[int(mb.seq_index_T[t])], t - cu[int(mb.seq_index_T[t])]) if mb.seq_index_T[t] >= 0 else None
                      for t in range(mb.num_tokens)]
            cp = mpu.get_context_parallel_world_size()
            if cp > 1:
                lay = context_parallel.layout(mb, cp, mpu.get_context_parallel_rank(), self.backend._pad_multiple())
                padded: list = [None] * lay.cu_padded[-1]
                for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
                    padded[lay.cu_padded[i]: lay.cu_padded[i] + b - a] = stream[a:b]
                stream = [padded[p] for p in lay.local_idx.tolist()]
            tp = mpu.get_tensor_model_parallel_world_size()
            if tp > 1 and self.backend.cfg.sequence_parallel:  # Megatron scatters the sequence in contiguous slices
                n = len(stream) // tp
                stream = stream[mpu.get_tensor_model_parallel_rank() * n: (mpu.get_tensor_model_parallel_rank() + 1) * n]
            out.append(stream)
        return out

    def sets(self, mbs, calls_per_mb: int) -> dict[tuple[bytes, int, int], list[tuple[int, ...]]]:
        """(token, layer) -> the expert sets of its calls, from the hooked calls of one pass over ``mbs``."""
        rows = self.tokens(mbs)
        n_layers = len(self.routers)
        assert len(self.calls) == len(mbs) * n_layers * calls_per_mb, (len(self.calls), len(mbs), n_layers, calls_per_mb)
        out: dict = {}
        for i, (layer, routing_map) in enumerate(self.calls):
            mb_rows = rows[i // (n_layers * calls_per_mb)]
            assert routing_map.shape[0] == len(mb_rows), (routing_map.shape, len(mb_rows))
            for row, token in enumerate(mb_rows):
                if token is not None:
                    chosen = tuple(routing_map[row].nonzero().flatten().tolist())
                    out.setdefault((token[0], token[1], layer), []).append(chosen)
        self.calls = []
        return out


def gathered(local: dict) -> dict:
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict = {}
    for part in parts:
        for k, v in part.items():
            merged.setdefault(k, []).extend(v)
    return merged


def scenario(path: str, *, recompute: bool = False, **mcfg) -> dict:
    """``mcfg``: ``policy.megatron_cfg`` keys, plus ``device`` and ``precision`` (backend_for)."""
    backend = backend_for(path, activation_checkpointing="full" if recompute else False, **mcfg)
    watch = RouterWatch(backend)
    batch = make_batch(11, n=8)
    policy = backend.run.policy
    backend.logprobs(batch)
    recorded = gathered(watch.sets(backend.micro_batches(batch, policy.sequence_packing.logprob_mb_tokens, 8), 1))
    metrics = backend.train(batch, SumNLL())
    train_mbs = [mb for start in (0, 4) for mb in backend.micro_batches(batch.select(range(start, start + 4)),
                                                                          policy.sequence_packing.train_mb_tokens, 4)]
    used = gathered(watch.sets(train_mbs, 2 if recompute else 1))
    differing = sum(1 for key, sets in used.items() for s in sets if s != recorded[key][0])
    return {"tokens": len(recorded), "train_calls": sum(len(v) for v in used.values()), "differing_calls": differing,
            # metrics are means over the call's optimizer steps: counts times steps are the call's totals
            "mismatch_fraction": metrics["moe/routing_mismatch_fraction"],
            "mismatched": metrics["moe/routing_mismatched_pairs"] * metrics["num_optimizer_steps"],
            "compared": metrics["moe/routing_compared_pairs"] * metrics["num_optimizer_steps"],
            "optimizer_steps": metrics["num_optimizer_steps"], "kernels": backend.kernels.describe()}


def router_keys(path: str) -> dict:
    """Router weights after one ``train`` call with the MoE keys (none, aux loss, frozen router), from the same start."""
    batch = make_batch(12, n=8)
    after = {}
    for name, mcfg in (("none", {}), ("aux_loss", dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1)),
                       ("frozen", dict(freeze_moe_router=True))):
        backend = backend_for(path, expert_model_parallel_size=2, **mcfg)
        metrics = backend.train(batch, SumNLL())
        after[name] = {n: t.clone() for chunk in backend.export_weights(chunk_bytes=1 << 16) for n, t in chunk}
        assert metrics["loss"] == metrics["loss"], metrics
    if dist.get_rank() != 0:
        return {}
    from dist_worker import checkpoint_tensors

    initial = checkpoint_tensors(path)
    gates = [k for k in initial if k.endswith("mlp.gate.weight")]

    def change(a, b, keys):
        return max(float((a[k] - b[k]).abs().max()) for k in keys)

    others = [k for k in initial if k not in gates]
    return {"none_router_moved": change(after["none"], initial, gates),
            "aux_vs_none_router": change(after["aux_loss"], after["none"], gates),
            "frozen_router_moved": change(after["frozen"], initial, gates),
            "frozen_others_moved": change(after["frozen"], initial, others)}


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    model, tmp = sys.argv[4], Path(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    scenarios = {
        "ep2_r2": dict(expert_model_parallel_size=2, moe_router_replay="r2"),
        "ep2_no_replay": dict(expert_model_parallel_size=2, moe_routing_metrics=True),
        "ep2_r2_grouped_mm": dict(expert_model_parallel_size=2, moe_router_replay="r2", moe_experts_impl="grouped_mm"),
        "ep1_r2_full_recompute": dict(moe_router_replay="r2", recompute=True),
        "cp2_r2": dict(context_parallel_size=2, moe_router_replay="r2"),
        "tp2_sp_ep2_r2": dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                              expert_tensor_parallel_size=1,
                              moe_router_replay="r2"),
    }
    out: dict = {}
    for name, kwargs in scenarios.items():
        record(out, name, lambda k=kwargs: scenario(model, **k))
    record(out, "moe_keys", lambda: router_keys(model))
    for key, value in out.items():
        if isinstance(value, str) and value.startswith("ERROR"):
            print(f"[rank {rank}] {key}: {value}", file=sys.stderr)
    (tmp / f"rank_{rank}.json").write_text(json.dumps(out, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
