"""Compose a GRPO run in Python: your own dataset, environment and algorithm objects.

    python examples/compose.py                                # two GRPO steps, a few seconds on a CPU
    RLCORE_DISABLE_PLUGINS=math python examples/compose.py    # the same: no math plugin is needed

Each object passed to ``rlcore.run`` replaces the plugin lookup of its kind, so the recipe has no
``data`` or ``env.<name>`` section and no environment or dataset plugin needs to be installed;
what is not passed (here the fsdp2 training backend and the built-in ``hf`` generator) comes from
the config. The model is a tiny random-init Llama written with ``save_pretrained`` (nothing is
downloaded); the task is to repeat a digit.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch

import rlcore
from rlcore.algorithms.config import GRPOConfig
from rlcore.algorithms.grpo import GRPO
from rlcore.interfaces import EnvStep, Sample


class RepeatDigitDataset:
    """A dataset is any object with ``train`` and ``validation`` lists of :class:`Sample`
    whose ``prompt_ids`` are the tokenized prompt (chat template applied)."""

    def __init__(self, tokenizer, num_train: int = 64, num_validation: int = 8, seed: int = 0):
        rng = random.Random(seed)

        def sample(index: int) -> Sample:
            digit = str(rng.randrange(10))
            messages = [{"role": "user", "content": f"Repeat {digit}"}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            return Sample(prompt=messages, answer=digit, prompt_ids=list(ids), index=index)

        self.train = [sample(i) for i in range(num_train)]
        self.validation = [sample(i) for i in range(num_validation)]


class StartsWithAnswer:
    """An environment is any object with ``step(samples, histories) -> list[EnvStep]``;
    ``histories[i][-1]`` is the model's latest turn for ``samples[i]``. Pure: it never raises."""

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        return [EnvStep(reward=float(h[-1].strip().startswith(str(s.answer)))) for s, h in zip(samples, histories)]


class MeanBaselineGRPO(GRPO):
    """An algorithm object: GRPO with a plain group-mean baseline (no std division).
    Overriding one method of a built-in algorithm is all a variant needs."""

    name = "mean_baseline_grpo"

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        means_G = torch.zeros(int(group_ids_N.max()) + 1).scatter_reduce(0, group_ids_N, rewards_N, "mean",
                                                                      include_self=False)
        return rewards_N - means_G[group_ids_N]


def main(workdir: Path) -> dict:
    from rlcore.testing.tiny import build_tiny_model
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(workdir / "model", hidden_size=128, num_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = rlcore.build_config({
        "policy": {
            "model_name": str(model_dir), "precision": "float32", "max_total_sequence_length": 32,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True},
            "generation": {"backend": "hf", "max_new_tokens": 2},
        },
        "train": {"num_prompts_per_step": 4, "max_num_steps": 2, "seed": 0},
        "grpo": {"num_generations_per_prompt": 4},
        "logger": {"log_dir": str(workdir / "run"), "print_table": False},
    })
    result = rlcore.run(config, dataset=RepeatDigitDataset(tokenizer), environment=StartsWithAnswer(),
                        algorithm=MeanBaselineGRPO(GRPOConfig(kl_coef=0.0)))
    for record in result["records"]:
        print(f"step {record['step']}: reward {record['train/reward_mean']:.3f}, loss {record['train/loss']:.4f}")
    return result


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        done = main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp))
        print(f"{done['summary']['steps']} GRPO steps")
