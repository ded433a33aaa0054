"""One rank of the 2-process gloo checks (launched by test_distributed.py).

Usage: python dist_worker.py RANK WORLD PORT MODELS_JSON OUT_DIR. Runs every scenario in one
process (imports cost more than the checks on a loaded 2-core machine) and writes
``OUT_DIR/rank_<r>.json`` with one measured number per check; the test asserts on them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import attrs
import torch
import torch.distributed as dist


class SumNLL:
    """Advantage-weighted token NLL, globally normalized: loss = -sum(A_t * m_t * logp_t) / N_valid_tokens."""

    name, uses_reference, uses_old_logprobs, loss_level = "test_pg", False, False, "token"

    def loss(self, logprobs_T, mb, totals):
        weighted_T = mb.token_fields["advantages"].to(logprobs_T) * mb.loss_mask_T.to(logprobs_T) * logprobs_T
        loss = -weighted_T.sum() / max(totals.num_valid_tokens, 1)
        return loss, {"valid_tokens": float(mb.loss_mask_T.sum())}


def make_batch(seed: int, n: int = 6, vocab: int = 100):
    from rlcore.interfaces import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    ids, masks, adv = [], [], []
    for i in range(n):
        length = int(torch.randint(5, 24, (1,), generator=g))
        ids.append(torch.randint(3, vocab, (length,), generator=g))
        mask = torch.ones(length)
        mask[: length // 3] = 0  # prompt part
        masks.append(mask)
        adv.append(torch.full((length,), float(torch.randn(1, generator=g))))
    return SequenceBatch(input_ids=ids, loss_mask=masks, token_fields={"advantages": adv})


def run_config(path: str, mb_tokens: int = 40, **mcfg):
    from rlcore.config import RunConfig
    from rlcore.config.schema import PolicyConfig, SequencePackingConfig
    from rlcore_megatron.config import MegatronConfig

    policy = PolicyConfig(model_name=path, precision="float32",
                          sequence_packing=SequencePackingConfig(train_mb_tokens=mb_tokens, logprob_mb_tokens=mb_tokens))
    # eps well above fp32 summation noise of tiny gradients: Adam's first step is lr*g/(|g|+eps), which
    # amplifies reduction-order differences ~lr/(4 eps) times where |g| ~ eps.
    opt = mcfg.pop("optimizer", MegatronOptimizerConfig(lr=1e-3, weight_decay=0.01, adam_eps=1e-6))  # betas, clip_grad from policy
    return RunConfig(policy=policy), MegatronConfig(enabled=True, optimizer=opt, **mcfg)


from rlcore_megatron.config import MegatronOptimizerConfig  # noqa: E402


def backend_for(path: str, **mcfg):
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import build_backend

    run, cfg = run_config(path, **mcfg)
    return build_backend(run, cfg, WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size()))


def megatron_logits(backend, batch) -> list[torch.Tensor] | None:
    """Full-vocab logits per sequence on rank 0, through the backend's schedule (PP-aware)."""
    from megatron.core import parallel_state as mpu
    from rlcore.data.packing import unpack

    mbs = backend.micro_batches(batch, 64, 4)

    def loss_fn(mb, _logprobs_fn, hidden):
        logits_TV = output_logits(backend.module, hidden)
        parts = [torch.empty_like(logits_TV) for _ in range(mpu.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, logits_TV.contiguous(), group=mpu.get_tensor_model_parallel_group())
        full_TV = torch.cat(parts, -1)
        rows = dict(zip(mb.seq_ids, unpack(full_TV, mb)))
        return hidden.sum() * 0, torch.tensor(1), {"rows": rows}

    from rlcore_megatron import cpu_shims
    from rlcore_megatron.output import output_logits

    with torch.no_grad(), cpu_shims.active():  # a private call: the public methods enter the shims themselves
        outs = backend._run_schedule(mbs, loss_fn, forward_only=True)
    local = {}
    if backend.ranks.reports:
        for o in outs:
            local.update(o["rows"])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {k: v for part in gathered for k, v in part.items()}
    return [merged[i] for i in range(len(batch))]


def hf_logits(model, batch) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(ids[None]).logits[0] for ids in batch.input_ids]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def on_mask(values: list[torch.Tensor], batch) -> list[torch.Tensor]:
    """Each sequence's values on its loss-masked tokens: the backend computes logprobs only there."""
    return [v[m > 0] for v, m in zip(values, batch.loss_mask)]


def check_parity(path: str, **mcfg) -> float:
    from transformers import AutoModelForCausalLM

    backend = backend_for(path, **mcfg)
    batch = make_batch(1)
    backend.module.eval()
    ours = megatron_logits(backend, batch)
    ref = hf_logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), batch)
    return max_diff(ours, ref)


def check_logprobs(path: str, **mcfg) -> float:
    """Backend logprobs (rank 0) vs Hugging Face; every rank returns the same number."""
    from rlcore.training.ops import token_logprobs
    from transformers import AutoModelForCausalLM

    backend = backend_for(path, **mcfg)
    batch = make_batch(6, n=5)
    ours = backend.logprobs(batch)
    diff = [0.0]
    if dist.get_rank() == 0:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            ref = [token_logprobs(hf(ids[None]).logits[0], ids) for ids in batch.input_ids]
        diff = [max_diff(on_mask(ours, batch), on_mask(ref, batch))]
    dist.broadcast_object_list(diff, src=0)
    return diff[0]


def reference_step(path: str, batch, run, cfg):
    """Plain single-process HF + torch AdamW step with the backend's hyperparameters and loss."""
    from rlcore.training.ops import token_logprobs
    from rlcore.data.packing import make_micro_batches, step_totals
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    from rlcore_megatron.parallel import optimizer_config

    totals, algo, o = step_totals(batch), SumNLL(), optimizer_config(cfg, run)  # unset keys resolved from policy
    total_loss = 0.0
    for mb in make_micro_batches(batch, run.policy.sequence_packing.train_mb_tokens):
        logits = torch.cat([model(batch.input_ids[i][None]).logits[0] for i in mb.seq_ids])
        logits = torch.nn.functional.pad(logits, (0, 0, 0, mb.input_ids_T.numel() - logits.shape[0]))
        loss, _ = algo.loss(token_logprobs(logits, mb.input_ids_T, mb.cu_seqlens), mb, totals)
        loss.backward()
        total_loss += float(loss)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad))
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    opt.step()
    return total_loss, grad_norm, checkpoint_names(model.state_dict())


def checkpoint_names(state: dict) -> dict[str, torch.Tensor]:
    """transformers 5 keeps MoE experts fused in memory; checkpoints (and our export) name each expert."""
    out = {}
    for name, t in state.items():
        t = t.detach()
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e, w in enumerate(t):
                out[f"{pre}{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


def train_vs_reference(path: str, **mcfg) -> dict:
    """One step under a parallel layout vs the single-process reference: max |loss diff|, |weight diff|."""
    batch = make_batch(5, n=8)
    backend = backend_for(path, **mcfg)
    metrics = backend.train(batch, SumNLL())
    weights = exported(backend)
    if dist.get_rank() != 0:
        return {}
    run, cfg = run_config(path, **mcfg)
    ref_loss, ref_norm, ref_weights = reference_step(path, batch, run, cfg)
    return {"loss": abs(metrics["loss"] - ref_loss), "grad_norm": abs(metrics["grad_norm"] - ref_norm) / ref_norm,
            "weights": max(float((weights[k] - ref_weights[k]).abs().max()) for k in ref_weights)}


def every_row(backend):
    """``backend`` with its micro-batches' row selection dropped: the output layer and logprob
    kernel run on every row of the stream (the path Megatron's own ``_postprocess`` takes)."""
    plan = backend.micro_batches
    backend.micro_batches = lambda *args, **kwargs: [attrs.evolve(mb, logprob_rows_R=None) for mb in plan(*args, **kwargs)]
    return backend


def logit_rows(backend, fn) -> tuple[object, int]:
    """(``fn()``, rows of logits the output layer produced on this rank meanwhile; 0 on a stage without it)."""
    rows = []
    layer = getattr(backend.module, "output_layer", None)  # only the last pipeline stage has one
    if layer is None:
        return fn(), 0
    hook = layer.register_forward_hook(lambda module, args, out: rows.append(out[0].shape[0]))
    try:
        return fn(), sum(rows)
    finally:
        hook.remove()


def check_positions(path: str, **mcfg) -> dict:
    """Logprobs and one training step with the output layer on the loss rows only vs on every
    row, in the same layout from the same weights: max differences, and the logit rows computed."""
    from megatron.core import parallel_state as mpu

    batch = make_batch(5, n=8)
    selected, full = backend_for(path, **mcfg), every_row(backend_for(path, **mcfg))
    lp_sel, rows_sel = logit_rows(selected, lambda: selected.logprobs(batch))
    lp_full, rows_full = logit_rows(full, lambda: full.logprobs(batch))
    m_sel, m_full = selected.train(batch, SumNLL()), full.train(batch, SumNLL())
    w_sel, w_full = exported(selected), exported(full)
    counts = torch.tensor([rows_sel, rows_full], dtype=torch.long)
    dist.all_reduce(counts)  # CP ranks split the rows, TP ranks each compute all of them, PP: the last stage
    if dist.get_rank() != 0:
        return {}
    copies = mpu.get_tensor_model_parallel_world_size()
    return {"logprobs": max_diff(on_mask(lp_sel, batch), on_mask(lp_full, batch)),
            "off_mask": max(float(v[m == 0].abs().max()) for v, m in zip(lp_sel, batch.loss_mask)),
            "rows_selected": int(counts[0]), "rows_full": int(counts[1]),
            "rows_needed": copies * sum(int((m[1:] > 0).sum()) for m in batch.loss_mask),
            "loss": abs(m_sel["loss"] - m_full["loss"]), "grad_norm": abs(m_sel["grad_norm"] - m_full["grad_norm"]) / m_full["grad_norm"],
            "weights": max(float((w_sel[k] - w_full[k]).abs().max()) for k in w_full),
            "change": max(float((w_sel[k] - v).abs().max()) for k, v in checkpoint_tensors(path).items())}


def check_vs_fsdp2(path: str) -> dict:
    """The same step on the fsdp2 backend (DP=2) and on megatron (DP=2, distributed optimizer).

    Weight decay 0: fsdp2 decays every parameter, Megatron (like most recipes) skips norms/biases.
    """
    from rlcore.config.schema import OptimizerConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import DTensorConfig

    batch = make_batch(7, n=8)
    run, _ = run_config(path)
    policy = attrs.evolve(run.policy, optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0, eps=1e-6))
    run = attrs.evolve(run, policy=policy)
    world = WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size())
    fsdp2 = FSDP2Backend(run, DTensorConfig(), world)
    m_fsdp2 = fsdp2.train(batch, SumNLL())
    w_fsdp2 = exported(fsdp2)
    fsdp2.shutdown()
    meg = backend_for(path, optimizer=MegatronOptimizerConfig(lr=1e-3, weight_decay=0.0, adam_eps=1e-6))
    m_meg = meg.train(batch, SumNLL())
    w_meg = exported(meg)
    if dist.get_rank() != 0:
        return {}
    return {"loss": abs(m_meg["loss"] - m_fsdp2["loss"]),
            "weights": max(float((w_meg[k] - w_fsdp2[k]).abs().max()) for k in w_fsdp2),
            "change": max(float((w_meg[k] - v).abs().max()) for k, v in checkpoint_tensors(path).items())}


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def exported(backend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for chunk in backend.export_weights(chunk_bytes=1 << 16) for n, t in chunk}


def check_grouped_mm_experts(path: str, tmp: Path, **mcfg) -> dict:
    """torch grouped GEMM experts vs the loop over experts in the same layout: logits, logprobs, one training
    step (loss, grad norm, weights in HF names); then the grouped model's checkpoint resumes to the
    same weights as training on uninterrupted, and its model part reads into the loop at EP=1."""
    batch, batch2, probe = make_batch(5, n=8), make_batch(6, n=8), make_batch(3, n=8)
    runs, logits = {}, {}
    for impl in ("loop", "grouped_mm"):
        backend = backend_for(path, moe_experts_impl=impl, **mcfg)
        logits[impl] = megatron_logits(backend, probe)
        runs[impl] = backend.logprobs(probe), backend.train(batch, SumNLL()), exported(backend), backend
    grouped = runs["grouped_mm"][3]
    grouped.save_checkpoint(str(tmp / "ckpt-grouped-mm"))
    grouped.train(batch2, SumNLL())
    uninterrupted = exported(grouped)
    fresh = backend_for(path, moe_experts_impl="grouped_mm", **mcfg)
    fresh.load_checkpoint(str(tmp / "ckpt-grouped-mm"))
    fresh.train(batch2, SumNLL())
    resumed = exported(fresh)
    from rlcore_megatron import checkpoint, cpu_shims

    resharded = backend_for(path, moe_experts_impl="loop")  # EP=1, DP=2: as `rlcore export` reshards
    with cpu_shims.active():
        checkpoint.load_model(resharded, str(tmp / "ckpt-grouped-mm"))
    into_loop = exported(resharded)
    if dist.get_rank() != 0:
        return {}
    (lp_l, m_l, w_l, _), (lp_g, m_g, w_g, _) = runs["loop"], runs["grouped_mm"]
    return {"logits": max_diff(logits["loop"], logits["grouped_mm"]),
            "logprobs": max_diff(on_mask(lp_l, probe), on_mask(lp_g, probe)), "loss": abs(m_l["loss"] - m_g["loss"]),
            "grad_norm": abs(m_l["grad_norm"] - m_g["grad_norm"]) / m_l["grad_norm"],
            "names_equal": float(set(w_l) == set(w_g)), "weights": max(float((w_l[k] - w_g[k]).abs().max()) for k in w_l),
            "change": max(float((w_g[k] - v).abs().max()) for k, v in checkpoint_tensors(path).items()),
            "resume": max(float((uninterrupted[k] - resumed[k]).abs().max()) for k in uninterrupted),
            "into_loop_ep1": max(float((w_g[k] - into_loop[k]).abs().max()) for k in w_g)}


def check_training(path: str, tmp: Path, out: dict) -> None:
    from transformers import AutoModelForCausalLM

    batch1, batch2 = make_batch(2, n=8), make_batch(3, n=8)
    backend = backend_for(path)
    metrics = backend.train(batch1, SumNLL())
    weights1 = exported(backend)
    if dist.get_rank() == 0:
        run, cfg = run_config(path)
        ref_loss, ref_norm, ref_weights = reference_step(path, batch1, run, cfg)
        out["grad_norm_rel_diff"] = abs(metrics["grad_norm"] - ref_norm) / ref_norm
        out["train_loss_diff"] = abs(metrics["loss"] - ref_loss)
        out["train_loss"] = metrics["loss"]
        out["train_weight_diff"] = max(float((weights1[k] - ref_weights[k]).abs().max()) for k in ref_weights)
        out["train_weight_change"] = max(float((weights1[k] - v).abs().max()) for k, v in
                                         AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items())
        out["num_micro_batches"] = metrics["num_micro_batches"]
    # export -> reload into transformers
    backend.export_hf(str(tmp / "export"))
    ours = megatron_logits(backend, batch2)
    if dist.get_rank() == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(tmp / "export", dtype=torch.float32)
        out["export_tensor_diff"] = max(float((reloaded.state_dict()[k] - v).abs().max()) for k, v in weights1.items())
        out["export_logits_diff"] = max_diff(ours, hf_logits(reloaded, batch2))
    # logprobs: policy vs reference
    lp = backend.logprobs(batch2)
    ref_lp = backend.logprobs(batch2, reference=True)
    if dist.get_rank() == 0:
        from rlcore.training.ops import token_logprobs

        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        expect = [token_logprobs(base(ids[None]).logits[0].detach(), ids) for ids in batch2.input_ids]
        out["ref_logprob_diff"] = max_diff(on_mask(ref_lp, batch2), on_mask(expect, batch2))
        expect_now = [token_logprobs(ours[i], ids) for i, ids in enumerate(batch2.input_ids)]
        out["policy_logprob_diff"] = max_diff(on_mask(lp, batch2), on_mask(expect_now, batch2))
    # resume equals uninterrupted
    backend.save_checkpoint(str(tmp / "ckpt"))
    m2 = backend.train(batch2, SumNLL())
    uninterrupted = exported(backend)
    fresh = backend_for(path)
    fresh.load_checkpoint(str(tmp / "ckpt"))
    m2b = fresh.train(batch2, SumNLL())
    resumed = exported(fresh)
    if dist.get_rank() == 0:
        out["resume_weight_diff"] = max(float((uninterrupted[k] - resumed[k]).abs().max()) for k in uninterrupted)
        out["resume_loss_diff"] = abs(m2["loss"] - m2b["loss"])
        out["resume_lr"] = [m2["lr"], m2b["lr"]]
    # a non-finite loss skips the update
    bad = make_batch(4, n=4)
    bad.token_fields["advantages"][0][:] = float("nan")
    before = exported(fresh)
    m3 = fresh.train(bad, SumNLL())
    after = exported(fresh)
    if dist.get_rank() == 0:
        out["nonfinite_skipped"] = m3.get("skipped_nonfinite", 0.0)
        out["nonfinite_weight_change"] = max(float((before[k] - after[k]).abs().max()) for k in before)


def check_release(path: str) -> dict:
    """offload/onload round trips (weights kept for a refit, then released too) between two training steps of DP=2
    with the distributed optimizer, beside a backend that never releases: every state tensor bitwise equal after
    each trip, its storage empty while out, and the next step the same to the bit."""
    from rlcore.testing.offload import release_round_trips

    batch1, batch2 = make_batch(2, n=8), make_batch(3, n=8)
    released, plain = backend_for(path), backend_for(path)
    assert released.cfg.optimizer.use_distributed_optimizer and dist.get_world_size() == 2
    released.train(batch1, SumNLL()), plain.train(batch1, SumNLL())
    out = release_round_trips(released, released.state_tensors, lambda: [b.param_data for b in released.model.buffers])
    m1, m2 = released.train(batch2, SumNLL()), plain.train(batch2, SumNLL())
    out["loss_equal"] = m1["loss"] == m2["loss"]
    a, b = exported(released), exported(plain)
    out["weights_equal"] = all(torch.equal(a[k], b[k]) for k in b) if dist.get_rank() == 0 else True
    out["state_equal"] = all(torch.equal(x, y) for x, y in zip(released.state_tensors(), plain.state_tensors()))
    return out


# ---- LoRA (rlcore_megatron.lora) -----------------------------------------------------------------
LORA = dict(enabled=True, rank=4, alpha=8.0)
LORA_LR, LORA_ADAM_EPS = 1e-2, 1e-3  # eps far above the gradients' rounding differences (see test_distributed.py)


def lora_run(path: str, *, distributed_optimizer: bool = False, precision: str = "float32", **mcfg):
    """A LoRA run (rank 4, alpha 8, every projection); no clipping, so gradients compare as computed; without the
    distributed optimizer every data-parallel rank holds the whole summed gradient after a step."""
    from rlcore.config.schema import LoraConfig

    opt = MegatronOptimizerConfig(lr=LORA_LR, weight_decay=0.0, adam_eps=LORA_ADAM_EPS, use_distributed_optimizer=distributed_optimizer)
    run, cfg = run_config(path, optimizer=opt, **mcfg)
    return attrs.evolve(run, policy=attrs.evolve(run.policy, lora=LoraConfig(**LORA), max_grad_norm=None,
                                                 precision=precision)), cfg


def lora_backend(path: str, **kwargs):
    from rlcore.interfaces import WorldInfo
    from rlcore_megatron.backend import build_backend

    run, cfg = lora_run(path, **kwargs)
    return build_backend(run, cfg, WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size()))


def random_adapters(backend) -> dict[str, torch.Tensor]:
    """Nonzero A and B (B starts at zero, which leaves A without a gradient) for every adapter, under PEFT's names,
    on every rank; the same whatever the layout."""
    from rlcore_megatron.lora import adapter_tensors

    shapes = [sorted((n, tuple(t.shape)) for n, t in adapter_tensors(backend.module, backend.hf_config).items())]
    dist.broadcast_object_list(shapes, src=0)
    g = torch.Generator().manual_seed(11)
    return {n: torch.randn(shape, generator=g) * 0.2 for n, shape in shapes[0]}


def lora_step(backend, adapters, batch) -> tuple[dict, dict, dict, float]:
    """(metrics, adapter gradients, adapters after the step, largest difference between the merged weights the
    backend exports and the base merged with those adapters here) of one step from ``adapters``; whole, on rank 0."""
    from rlcore.training.lora import merge
    from rlcore_megatron.lora import adapter_tensors, load_adapter_tensors

    load_adapter_tensors(backend.module, adapters)
    metrics = backend.train(batch, SumNLL())
    grads = adapter_tensors(backend.module, backend.hf_config, of=lambda p: p.main_grad)
    after, merged = adapter_tensors(backend.module, backend.hf_config), exported(backend)
    merge_diff = 0.0
    if dist.get_rank() == 0:
        scale = LORA["alpha"] / LORA["rank"]
        for name, base in checkpoint_tensors(backend.model_path).items():
            a, module = after.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight"), name.removesuffix(".weight")
            want = base if a is None else merge(base, a, after[f"base_model.model.{module}.lora_B.weight"], scale, base.dtype)
            merge_diff = max(merge_diff, float((merged[name] - want).abs().max()))
    return metrics, grads, after, merge_diff


def max_diff_dict(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def check_lora_layouts(path: str) -> dict:
    """One LoRA step from the same adapters at TP=2, TP=2 with sequence parallelism, PP=2 and CP=2 vs TP=1 (DP=2):
    loss, adapter gradients (whole, PEFT names) and merged weights after the step."""
    batch = make_batch(5, n=8)
    base = lora_backend(path)
    adapters = random_adapters(base)
    ref = lora_step(base, adapters, batch)
    out = {}
    for name, mcfg in {"tp2": dict(tensor_model_parallel_size=2),
                       "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
                       "pp2": dict(pipeline_model_parallel_size=2), "cp2": dict(context_parallel_size=2)}.items():
        metrics, grads, after, merge_diff = lora_step(lora_backend(path, **mcfg), adapters, batch)
        if dist.get_rank() == 0:
            out.update({f"{name}_loss": abs(metrics["loss"] - ref[0]["loss"]), f"{name}_grads": max_diff_dict(grads, ref[1]),
                        f"{name}_adapters": max_diff_dict(after, ref[2]), f"{name}_merge": merge_diff})
    if dist.get_rank() == 0:
        out.update(loss=ref[0]["loss"], merge=ref[3], grad_max=max(float(g.abs().max()) for g in ref[1].values()),
                   grad_min=min(float(g.abs().max()) for g in ref[1].values()),  # every adapter got a gradient
                   change=max_diff_dict(ref[2], adapters))
    return out


def check_lora_vs_fsdp2(path: str) -> dict:
    """The same adapters and batch through the fsdp2 backend (PEFT) and this one, DP=2: loss and adapter gradients."""
    from torch.distributed.tensor import distribute_tensor

    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import DTensorConfig

    batch = make_batch(7, n=8)
    meg = lora_backend(path)
    adapters = random_adapters(meg)
    m_meg, g_meg, _, _ = lora_step(meg, adapters, batch)
    run, _ = lora_run(path)
    fsdp2 = FSDP2Backend(run, DTensorConfig(), WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size()))
    params = {f"base_model.model.{n.replace('.default.', '.')}": p for n, p in fsdp2.model.named_parameters() if ".lora_" in n}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(distribute_tensor(adapters[name].to(p.dtype), p.device_mesh, p.placements))
    fsdp2.optimizer.zero_grad = lambda set_to_none=True: None  # keep the step's gradients to read them after it
    m_fsdp2 = fsdp2.train(batch, SumNLL())
    g_fsdp2 = {name: p.grad.full_tensor() for name, p in params.items()}
    fsdp2.shutdown()
    if dist.get_rank() != 0:
        return {}
    return {"loss": abs(m_meg["loss"] - m_fsdp2["loss"]), "grads": max_diff_dict(g_meg, g_fsdp2),
            "grad_min": min(float(g.abs().max()) for g in g_fsdp2.values())}


def hf_logprobs(model, batch) -> list[torch.Tensor]:
    from rlcore.training.ops import token_logprobs

    with torch.no_grad():
        return [token_logprobs(model(ids[None]).logits[0], ids) for ids in batch.input_ids]


def check_lora_export_resume(path: str, tmp: Path) -> dict:
    """DP=2 with the distributed optimizer, adapters from their own initialisation: what trains, the reference,
    the merged export and the PEFT adapter against transformers + peft, and a checkpoint of the adapters alone
    that resumes to the same step."""
    from megatron.core import dist_checkpointing
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch1, batch2, probe = make_batch(2, n=8), make_batch(3, n=8), make_batch(4, n=6)
    backend = lora_backend(path, distributed_optimizer=True)
    trained = {id(p) for buffer in backend.model.buffers for p in buffer.params}
    adapters = {id(p) for n, p in backend.module.named_parameters() if ".lora." in n}
    out = {"only_adapters_train": trained == adapters and all(
        p.requires_grad == (".lora." in n) for n, p in backend.module.named_parameters())}
    for _ in range(2):  # B starts at zero: the second step moves A too
        backend.train(batch1, SumNLL())
    policy, reference = backend.logprobs(probe), backend.logprobs(probe, reference=True)
    backend.export_hf(str(tmp / "lora-export"))
    backend.save_checkpoint(str(tmp / "lora-ckpt"))
    m2 = backend.train(batch2, SumNLL())
    uninterrupted = exported(backend)
    fresh = lora_backend(path, distributed_optimizer=True)
    fresh.load_checkpoint(str(tmp / "lora-ckpt"))
    m2b = fresh.train(batch2, SumNLL())
    resumed = exported(fresh)
    if dist.get_rank() != 0:
        return out
    model_keys = [k for k in dist_checkpointing.load_tensors_metadata(str(tmp / "lora-ckpt" / "megatron"))
                  if not k.startswith("optimizer.")]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base_lp = hf_logprobs(base, probe)
    peft_lp = hf_logprobs(PeftModel.from_pretrained(base, tmp / "lora-export" / "adapter").eval(), probe)
    merged_lp = hf_logprobs(AutoModelForCausalLM.from_pretrained(tmp / "lora-export", dtype=torch.float32), probe)
    out.update(reference=max_diff(on_mask(reference, probe), on_mask(base_lp, probe)),
               moved=max_diff(on_mask(policy, probe), on_mask(base_lp, probe)),
               peft=max_diff(on_mask(policy, probe), on_mask(peft_lp, probe)),
               merged=max_diff(on_mask(policy, probe), on_mask(merged_lp, probe)),
               ckpt_adapters=len(model_keys), ckpt_not_adapters=[k for k in model_keys if ".lora." not in k],
               resume_weights=max_diff_dict(uninterrupted, resumed), resume_loss=abs(m2["loss"] - m2b["loss"]))
    return out


def check_lora_bf16(path: str) -> dict:
    """bf16 LoRA: the frozen base stays in bf16 outside the gradient buffers, and the optimizer's fp32 main weights
    and state cover the adapters alone."""
    backend = lora_backend(path, precision="bfloat16", distributed_optimizer=True)
    backend.train(make_batch(2, n=8), SumNLL())
    named = dict(backend.module.named_parameters())
    base = [p for n, p in named.items() if ".lora." not in n]
    adapter_numel = sum(p.numel() for n, p in named.items() if ".lora." in n)
    inner = backend.optimizer.optimizer
    main = sum(p.numel() for group in inner.param_groups for p in group["params"])
    counts = torch.tensor([main, adapter_numel], dtype=torch.long)
    dist.all_reduce(counts)  # the distributed optimizer splits the main weights over the DP ranks
    before = [p.detach().clone() for p in base]
    backend.offload()  # colocated release: the frozen base leaves with the rest, and comes back bit for bit
    released = all(p.untyped_storage().nbytes() == 0 for p in base)
    backend.onload()
    return {"base_released": released, "base_back": all(torch.equal(p, b) for p, b in zip(base, before)),
            "base_bf16": all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base),
            "main_fp32": all(p.dtype == torch.float32 for group in inner.param_groups for p in group["params"]),
            "main_numel": int(counts[0]), "adapter_numel": int(counts[1]) // dist.get_world_size()}


def record(out: dict, name: str, fn, *, spread: bool = False) -> None:
    """``out[name] = fn()``, or with ``spread`` ``out[f"{name}_{k}"]`` for each item of the dict it
    returns; a failure becomes ``out[name] = "ERROR <traceback>"``, which the test reports under the
    scenario's name; ``out[name + "_s"]``: its seconds. The workers of this folder report through it."""
    start = time.time()
    try:
        result = fn()
        if spread:
            out.update((f"{name}_{k}", v) for k, v in result.items())
        else:
            out[name] = result
    except Exception:  # noqa: BLE001 - reported to the test, which fails naming the scenario
        out[name] = "ERROR " + traceback.format_exc()
    out[name + "_s"] = time.time() - start


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    models, tmp = json.loads(sys.argv[4]), Path(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    scenarios = [(f"tp2_{arch}", lambda a=arch: check_parity(models[a], tensor_model_parallel_size=2,
                                                           sequence_parallel=a == "qwen3_moe"))  # MoE+TP needs SP
                 for arch in ("llama", "qwen2", "qwen3", "qwen3_moe")]
    scenarios += [("pp2_llama", lambda: check_parity(models["llama"], pipeline_model_parallel_size=2)),
                  ("ep2_qwen3_moe", lambda: check_parity(models["qwen3_moe"], expert_model_parallel_size=2)),
                  ("cp2_logprobs_qwen2", lambda: check_logprobs(models["qwen2"], context_parallel_size=2))]
    for name, fn in scenarios:
        record(out, name, fn)
    record(out, "release_dp2", lambda: check_release(models["llama"]), spread=True)
    variants = {
        "tp2_sp_full_recompute_llama": ("llama", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                                     activation_checkpointing="full")),
        "pp2_selective_recompute_llama": ("llama", dict(pipeline_model_parallel_size=2, activation_checkpointing="selective")),
        "tp2_qwen3": ("qwen3", dict(tensor_model_parallel_size=2)),
        "tp2_sp_qwen2": ("qwen2", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        "ep2_qwen3_moe": ("qwen3_moe", dict(expert_model_parallel_size=2)),
        "tp2_sp_qwen3_moe": ("qwen3_moe", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        "cp2_llama": ("llama", dict(context_parallel_size=2)),
        "tp2_sp_ep2_etp1_qwen3_moe": ("qwen3_moe", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                                        expert_model_parallel_size=2, expert_tensor_parallel_size=1)),
        "tp2_sp_ep2_grouped_mm_qwen3_moe": ("qwen3_moe", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                                              expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                                                              moe_experts_impl="grouped_mm")),
    }
    for name, (arch, mcfg) in variants.items():
        record(out, f"train_{name}", lambda a=arch, m=mcfg: train_vs_reference(models[a], **m), spread=True)
    record(out, "grouped_mm_ep2", lambda: check_grouped_mm_experts(models["qwen3_moe"], tmp, expert_model_parallel_size=2),
           spread=True)
    positions = {"tp2_sp_llama": ("llama", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
                 "cp2_llama": ("llama", dict(context_parallel_size=2)),
                 "pp2_llama": ("llama", dict(pipeline_model_parallel_size=2))}
    for name, (arch, mcfg) in positions.items():
        record(out, f"positions_{name}", lambda a=arch, m=mcfg: check_positions(models[a], **m), spread=True)
    try:
        import rlcore_fsdp2  # noqa: F401 - the comparison needs the other backend installed
    except ImportError:
        out["fsdp2_compare"] = "SKIP rlcore-fsdp2 is not installed"
    else:
        record(out, "fsdp2_compare", lambda: check_vs_fsdp2(models["llama"]), spread=True)
        record(out, "lora_fsdp2", lambda: check_lora_vs_fsdp2(models["llama"]), spread=True)
    record(out, "training", lambda: check_training(models["llama"], tmp, out) or {}, spread=True)  # it writes into out
    record(out, "lora_layouts", lambda: check_lora_layouts(models["llama"]), spread=True)
    record(out, "lora_export_resume", lambda: check_lora_export_resume(models["llama"], tmp), spread=True)
    record(out, "lora_bf16", lambda: check_lora_bf16(models["llama"]), spread=True)
    for key, value in out.items():
        if isinstance(value, str) and value.startswith("ERROR"):
            print(f"[rank {rank}] {key}: {value}", file=sys.stderr)
    (tmp / f"rank_{rank}.json").write_text(json.dumps(out, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
