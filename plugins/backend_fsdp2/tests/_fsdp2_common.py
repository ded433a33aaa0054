"""Shared by the 2-rank worker and the pytest side: batches, run configs and single-process
Hugging Face references (plain ``transformers`` + ``torch.optim.AdamW``, one sequence at a time,
no packing, no FSDP), written independently of the backend's code paths."""

from __future__ import annotations

import torch

# A large Adam eps keeps updates ~linear in the gradient (lr * g / eps for |g| << eps): Adam is
# otherwise blind to gradient scale (a sum-vs-mean bug would pass) and amplifies fp32 roundoff
# of near-zero gradients into ~lr-sized differences.
LR, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 2e-2, 1e-2, 0.01, 0.5
WARMUP, DECAY_STEPS = 2, 6
TRAIN_MB_TOKENS, LOGPROB_MB_TOKENS = 32, 80


def make_batch(seed: int, n: int = 7, min_len: int = 6, max_len: int = 30, vocab_hi: int = 100):
    """Sequences of random tokens; the first 2..L/2 tokens are the (masked) prompt."""
    from rlcore.interfaces import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids.append(torch.randint(3, vocab_hi, (length,), generator=g))
        prompt = int(torch.randint(2, length // 2 + 1, (1,), generator=g))
        masks.append(torch.cat([torch.zeros(prompt), torch.ones(length - prompt)]))
    return SequenceBatch(input_ids=ids, loss_mask=masks, seq_fields={"advantages": torch.randn(n, generator=g)})


def with_logprob_fields(batch, old, ref, seed: int):
    """old = given logprobs nudged by noise (so some ratios clip), ref = reference logprobs."""
    g = torch.Generator().manual_seed(seed)
    batch.token_fields["old_logprobs"] = [o + 0.05 * torch.randn(o.shape, generator=g) for o in old]
    batch.token_fields["ref_logprobs"] = [r.clone() for r in ref]
    return batch


def algorithm():
    """The registered ``grpo`` with a KL term (exercises reference logprobs) and tight clipping."""
    from rlcore.config.structure import structure
    from rlcore.plugins import get_plugin_manager

    reg = get_plugin_manager().get("algorithm", "grpo")
    return reg.build(structure(reg.config_cls, {"kl_coef": 0.1, "ratio_clip_min": 0.02, "ratio_clip_max": 0.02}))


def run_config(model_dir: str, *, gbs: int | None = None, packing: bool = True, precision: str = "float32", **dtensor):
    from rlcore.config.schema import (OptimizerConfig, PolicyConfig, RunConfig, SchedulerConfig,
                                      SequencePackingConfig)
    from rlcore_fsdp2.config import SECTION, DTensorConfig

    policy = PolicyConfig(
        model_name=str(model_dir), precision=precision, train_global_batch_size=gbs, max_grad_norm=MAX_GRAD_NORM,
        train_micro_batch_size=2, logprob_batch_size=3,
        optimizer=OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95), eps=EPS),
        scheduler=SchedulerConfig(warmup_steps=WARMUP, decay_style="cosine", decay_steps=DECAY_STEPS),
        sequence_packing=SequencePackingConfig(enabled=packing, train_mb_tokens=TRAIN_MB_TOKENS,
                                               logprob_mb_tokens=LOGPROB_MB_TOKENS),
    )
    return RunConfig(policy=policy, sections={SECTION: DTensorConfig(**dtensor)})


def attention_only_plan(model, sequence_parallel: bool):
    """A custom_parallel_plan: the built-in plan minus the MLP entries (MLPs stay replicated over TP)."""
    from rlcore_fsdp2.parallelize import tp_plan

    return {k: v for k, v in tp_plan(model, sequence_parallel).items() if ".mlp" not in k}


# ---- single-process references ---------------------------------------------------------------
def load_hf(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")


def hf_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Token-aligned logprobs of one unpacked sequence (index 0 is 0)."""
    logits = model(input_ids=ids[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None]).squeeze(1)
    return torch.cat([lp.new_zeros(1), lp])


def reference_train(model, batch, algo, gbs: int | None, steps_before: int = 0):
    """Optimizer steps of ``batch`` split by ``gbs``, as the backend's contract describes; the
    loss sees all of a step's sequences as one (padding-free) micro-batch. Returns (loss, grad
    norm before clipping) per step."""
    from rlcore.data.packing import make_micro_batches, step_totals
    from rlcore.training.schedule import lr_factor

    stats = []
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=WEIGHT_DECAY)
    gbs = gbs or len(batch)
    step = steps_before
    for start in range(0, len(batch), gbs):
        part = batch.select(range(start, min(start + gbs, len(batch))))
        for group in opt.param_groups:
            group["lr"] = LR * lr_factor(step, warmup_steps=WARMUP, decay_style="cosine", decay_steps=DECAY_STEPS,
                                         lr=LR, min_lr=0.0)
        totals = step_totals(part)
        (mb,) = make_micro_batches(part, max_tokens=10**9)
        logprobs_T = torch.cat([hf_logprobs(model, part.input_ids[i]) for i in mb.seq_ids])
        loss, _ = algo.loss(logprobs_T, mb, totals)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        stats.append((float(loss.detach()), float(norm)))
        opt.step()
        opt.zero_grad()
        step += 1
    return stats


def export(backend, chunk_bytes: int = 40_000):
    """The backend's weights under Hugging Face names (from export_weights) and each chunk's byte sizes."""
    params, sizes = {}, []
    for chunk in backend.export_weights(chunk_bytes=chunk_bytes):
        sizes.append([t.numel() * t.element_size() for _, t in chunk])
        params.update({name: t.detach().clone() for name, t in chunk})
    return params, sizes


def hf_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names (per-expert for Qwen3-MoE)."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.detach().clone() for k, v in revert_weight_conversion(model, dict(model.named_parameters())).items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), f"different names: {sorted(set(a) ^ set(b))[:5]}"
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
