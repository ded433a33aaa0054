"""Can vLLM take LoRA adapters instead of merged weights (``policy.lora.refit: adapter``, not built)?

    python benchmarks/check_vllm_lora_adapter.py [--work DIR]

The demo's tiny Llama gets adapters on every linear layer (``rlcore_fsdp2.lora.apply_lora``, rank 16)
with random nonzero ``B``; the adapter is written in PEFT's format by ``rlcore_fsdp2.lora.write_adapter``
(what ``export_hf`` writes) and served by a vLLM engine started with ``enable_lora`` through a
``LoRARequest``. Then the adapter is rewritten with other values and reloaded in place
(``load_inplace=True``, as a refit would). Each time, greedy tokens and their logprobs are compared
with ``transformers`` holding the fp32-merged weights (``rlcore_fsdp2.lora.merged``). Prints one JSON
row (``v*_check_s``: write, load, generate and the transformers reference together) and appends it
to ``benchmarks/results.jsonl`` (bench ``vllm_lora_adapter``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS = [[3, 10, 11, 12, 13], [3, 40, 41, 42]]
NEW_TOKENS = 8


def randomize_adapters(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=g))


def merged_reference(base_dir: Path, model: torch.nn.Module, cfg) -> torch.nn.Module:
    from rlcore_fsdp2.lora import merged
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    named = ((n, p.detach()) for n, p in model.named_parameters())
    plain.load_state_dict(dict(merged(named, cfg.alpha / cfg.rank, torch.float32)), strict=False)
    return plain


def compare(llm, request, reference) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=request, use_tqdm=False)
    equal, gap = True, 0.0
    for prompt, out in zip(PROMPTS, outputs):
        got = list(out.outputs[0].token_ids)
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        equal &= got == want
        with torch.no_grad():
            logprobs_tv = torch.log_softmax(reference(torch.tensor([prompt + got])).logits[0], -1)
        for i, (token, entry) in enumerate(zip(got, out.outputs[0].logprobs)):
            gap = max(gap, abs(float(logprobs_tv[len(prompt) - 1 + i, token]) - entry[token].logprob))
    return {"greedy_equal": equal, "max_abs_logprob_gap": gap, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--no-log", action="store_true", help="print only, append nothing to results.jsonl")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from rlcore.loading.loader import build_config
    from rlcore.cli.demo import DEMO_MODEL
    from rlcore.testing.tiny import build_tiny_model
    from rlcore_fsdp2.lora import adapter_tensors, apply_lora, write_adapter
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    work = Path(args.work or tempfile.mkdtemp(prefix="vllm-lora-"))
    base = build_tiny_model(work / "base", "llama", seed=0, **DEMO_MODEL)
    cfg = build_config({"policy": {"model_name": str(base), "lora": {"enabled": True, "rank": 16, "alpha": 32}}}).policy.lora
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), cfg)
    adapter = work / "adapter"

    started = time.perf_counter()
    llm = LLM(model=str(base), dtype="float32", enforce_eager=True, enable_lora=True, max_lora_rank=cfg.rank, max_loras=1,
              max_model_len=128, kv_cache_memory_bytes=128 << 20, max_num_seqs=16, seed=0)
    row: dict = {"variant": "adapter_refit", "engine_start_s": time.perf_counter() - started}
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base_tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    for version, seed in ((1, 0), (2, 1)):  # the second is a refit: same adapter id, reloaded in place
        randomize_adapters(model, seed)
        write_adapter(adapter, adapter_tensors(model.named_parameters()), cfg, str(base))
        started = time.perf_counter()
        request = LoRARequest("policy", 1, str(adapter), load_inplace=version > 1)
        result = compare(llm, request, merged_reference(base, model, cfg))
        row[f"v{version}_check_s"] = time.perf_counter() - started
        row[f"v{version}_greedy_equal"] = result["greedy_equal"]
        row[f"v{version}_max_abs_logprob_gap"] = result["max_abs_logprob_gap"]
        row[f"v{version}_differs_from_base"] = result["tokens"] != base_tokens
        row.setdefault("tokens_by_version", []).append(result["tokens"])
    row["reload_changed_outputs"] = row["tokens_by_version"][0] != row["tokens_by_version"][1]
    del row["tokens_by_version"]
    print(json.dumps(row))
    if not args.no_log:
        import results_log

        results_log.append([row], bench="vllm_lora_adapter", config="demo_tiny_llama_lora_r16", gpus=0)
    return row


if __name__ == "__main__":
    main()
