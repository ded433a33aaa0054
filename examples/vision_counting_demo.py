"""The vision-language demo on CPU: a tiny random-init Qwen2.5-VL (or LLaVA) learns to count coloured squares.

1. Build the model from a config (random weights, ``save_pretrained``) with its tokenizer and image processor.
2. SFT warm start on the counting task's reference answers (``algorithm.name=sft``), a few dozen steps.
3. GRPO from the warm start (``recipes/grpo_image_counting_tiny_cpu.yaml``), FSDP2 backend, hf generator
   (``--generator vllm``: vLLM, which takes LLaVA's prompts with images: ``--arch llava``).

Held-out greedy accuracy is read from each run's ``metrics.jsonl``; ``--require-gain G`` fails unless
GRPO raises it by at least G over the warm start's::

    python examples/vision_counting_demo.py --out runs/vision_demo --require-gain 0.2
    python examples/vision_counting_demo.py --out runs/vision_demo_vllm --arch llava --generator vllm \
        --sft-steps 15 --grpo-steps 200 --require-gain 0.2
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import yaml

import rlcore
from rlcore.testing.tiny_vlm import ARCHITECTURES, build_tiny_vlm

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo_image_counting_tiny_cpu.yaml"


def accuracies(log_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val/accuracy"] for r in rows if "val/accuracy" in r]


def run(recipe: dict, overrides: list[str]) -> None:
    rlcore.run(rlcore.build_config(recipe, overrides))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/vision_demo", help="working directory (replaced)")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--grpo-steps", type=int, default=20)
    parser.add_argument("--require-gain", type=float, default=None, metavar="G")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen2_5_vl")
    parser.add_argument("--generator", choices=("hf", "vllm"), default="hf", help="policy.generation.backend of both runs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    model = build_tiny_vlm(out / "model", args.arch)
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["policy"]["generation"]["backend"] = args.generator
    data = f"data.directory={out / 'data'}"

    sft = dict(recipe, algorithm={"name": "sft"})
    run(sft, [f"policy.model_name={model}", data, f"logger.log_dir={out / 'sft'}", "policy.optimizer.lr=1e-3",
              "train.num_prompts_per_step=32", f"train.max_num_steps={args.sft_steps}", f"train.val_period={args.sft_steps}"])
    run(recipe, [f"policy.model_name={out / 'sft' / 'model'}", data, f"logger.log_dir={out / 'grpo'}",
                 f"train.max_num_steps={args.grpo_steps}", f"train.val_period={args.grpo_steps}"])

    base, warm = accuracies(out / "sft")[0], accuracies(out / "sft")[-1]
    start, end = accuracies(out / "grpo")[0], accuracies(out / "grpo")[-1]
    print(f"held-out accuracy: random init {base:.3f}, SFT warm start {warm:.3f}, GRPO {start:.3f} -> {end:.3f}")
    if args.require_gain is not None and end - start < args.require_gain:
        raise SystemExit(f"GRPO raised held-out accuracy by {end - start:.3f}, less than {args.require_gain} (--require-gain)")
    return {"random_init": base, "sft": warm, "grpo_start": start, "grpo_end": end}


if __name__ == "__main__":
    main()
