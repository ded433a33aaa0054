"""Training a reward model on preference pairs: the ``reward_model`` algorithm's pair trainer.

One process on one device (``cuda`` when available, else the CPU), AdamW with the policy's
optimizer keys (``policy.optimizer``, ``policy.max_grad_norm``), gradient accumulation over
micro-batches of ``policy.train_micro_batch_size`` sequences (whole pairs). It does not go
through the fsdp2 or Megatron training backends: they train causal-LM logprobs, not a score head.
Its checkpoints (``checkpointing.enabled``) hold the weights as safetensors and the optimizer
state, read back with ``weights_only`` loading.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlcore.algorithms.reward_model import RewardModel
from rlcore.interfaces import PreferencePair
from rlcore.reward_model.scorer import RewardScorer


def pair_sequences(pairs: Sequence[PreferencePair], max_length: int) -> list[list[int]]:
    """prompt + chosen, prompt + rejected for each pair (2P sequences)."""
    out = []
    for pair in pairs:
        for which, response in (("chosen", pair.chosen_ids), ("rejected", pair.rejected_ids)):
            seq = list(pair.prompt_ids) + list(response)
            if len(seq) > max_length:
                raise ValueError(f"{pair.source}: prompt + {which} is {len(seq)} tokens, over "
                                 f"policy.max_total_sequence_length={max_length}")
            out.append(seq)
    return out


class RewardModelTrainer:
    """:class:`rlcore.interfaces.PairTrainer` of a scalar-head model."""

    def __init__(self, config: Any, algorithm: RewardModel, tokenizer: Any):
        policy = config.policy
        self.algorithm, self.tokenizer, self.max_length = algorithm, tokenizer, policy.max_total_sequence_length
        self.scorer = RewardScorer(policy.model_name, "auto", policy.precision, tokenizer.pad_token_id)
        opt = policy.optimizer
        self.optimizer = torch.optim.AdamW(self.scorer.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay,
                                           betas=opt.betas, eps=opt.eps)
        self.max_grad_norm = policy.max_grad_norm
        self.pairs_per_micro_batch = max(1, policy.train_micro_batch_size // 2)

    def train_pairs(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        model = self.scorer.model
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for start in range(0, len(pairs), self.pairs_per_micro_batch):
            chunk = pairs[start : start + self.pairs_per_micro_batch]
            scores = self.scorer.scores(pair_sequences(chunk, self.max_length))
            loss, metrics = self.algorithm.pair_loss(scores[0::2], scores[1::2])
            share = len(chunk) / len(pairs)  # the mean over the step's pairs
            (loss * share).backward()
            for key, value in {"loss": loss.detach(), **metrics}.items():
                totals[key] = totals.get(key, 0.0) + float(value) * share
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm if self.max_grad_norm else math.inf)
        totals["grad_norm"] = float(norm)
        if math.isfinite(totals["loss"]) and math.isfinite(totals["grad_norm"]):
            self.optimizer.step()
        else:
            totals["skipped_nonfinite"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        return {f"train/{k}": v for k, v in totals.items()}

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        self.scorer.model.eval()
        chunks = [pairs[i : i + self.pairs_per_micro_batch] for i in range(0, len(pairs), self.pairs_per_micro_batch)]
        scores = torch.cat([self.scorer.scores(pair_sequences(c, self.max_length)) for c in chunks])
        margin = scores[0::2] - scores[1::2]
        return {"val/accuracy": float((margin > 0).float().mean()), "val/reward_margin": float(margin.mean()),
                "val/chosen_reward": float(scores[0::2].mean()), "val/rejected_reward": float(scores[1::2].mean())}

    def save(self, path: str) -> None:
        self.scorer.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)

    def save_checkpoint(self, path: str) -> None:
        """Model weights (safetensors), optimizer state and the device's RNG, for resuming."""
        from safetensors.torch import save_model

        out = Path(path)
        out.mkdir(parents=True)
        save_model(self.scorer.model, str(out / "model.safetensors"))
        state = {"optimizer": self.optimizer.state_dict()}
        if self.scorer.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.scorer.device)
        with (out / "trainer.pt").open("wb") as f:
            torch.save(state, f)

    def load_checkpoint(self, path: str) -> None:
        from safetensors.torch import load_model

        from rlcore.training.safe_load import load_tensors

        load_model(self.scorer.model, str(Path(path) / "model.safetensors"), device=str(self.scorer.device))
        state = load_tensors(Path(path) / "trainer.pt")
        self.optimizer.load_state_dict(state["optimizer"])
        if "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.scorer.device)

    def shutdown(self) -> None:
        self.scorer.model.to("cpu")


def build(config: Any, algorithm: RewardModel, tokenizer: Any) -> RewardModelTrainer:
    return RewardModelTrainer(config, algorithm, tokenizer)
