"""The ``hf_static`` generator: ``transformers``' own ``generate()`` on a model in this process,
with a static (preallocated) KV cache.

A batch of prompts (``params.n`` rows each) is left-padded and decoded by one ``generate()`` call
per ``batch_rows`` rows. The logprob of each sampled token is read from ``generate``'s
``scores``: the logits after the sampling processors (temperature, top-k, top-p), so it is the
logprob under the distribution the token was drawn from, as a generator must report. A seeded
request reseeds torch's generator (in a forked RNG state) before each call: a seeded run repeats
exactly, though a row does not draw what it would alone.

Weights are loaded in place by :meth:`StaticCacheGenerator.update_weights` (Hugging Face names),
which :mod:`rlcore_hf_static.transport` feeds at refit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

import torch

from rlcore.config import ConfigError, RunConfig
from rlcore.interfaces import GenerationResult, NamedTensors, Placement, SamplingParams
from rlcore.training.ops import token_logprobs

from rlcore_hf_static.config import HFStaticGenerationConfig


class StaticCacheGenerator:
    """Implements :class:`rlcore.interfaces.Generator`."""

    def __init__(self, model_dir: str, config: HFStaticGenerationConfig, max_model_len: int, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.config, self.max_model_len, self.device = config, max_model_len, torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, config.dtype)).to(self.device).eval()
        # Each call passes a complete GenerationConfig; the checkpoint's defaults (its EOS, sampling
        # settings) must not merge into it, so the model's own is emptied.
        self.model.generation_config = GenerationConfig()
        tok = self.tokenizer
        self.pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
        self.weights_version = 0
        self._calls = 0  # model.generate() calls so far: what metrics() reports (the optional GeneratorMetrics)
        self._lock = threading.Lock()  # one generate/score/refit at a time: they share the model and its cache

    # ---- generation ------------------------------------------------------------------------
    def _generation_config(self, params: SamplingParams, max_new_tokens: int, stops: list[int]):
        from transformers import GenerationConfig

        sample = params.temperature > 0
        return GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=sample, num_beams=1,
            temperature=params.temperature if sample else None,
            top_k=(params.top_k if params.top_k > 0 else 0) if sample else None,  # 0: off (the default would be 50)
            top_p=params.top_p if sample else None, eos_token_id=stops or None, pad_token_id=self.pad_id,
            stop_strings=list(params.stop) or None, cache_implementation=self.config.cache_implementation,
            return_dict_in_generate=True, output_scores=True)

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        stops = set(params.stop_token_ids) | set(self.config.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stops.add(self.tokenizer.eos_token_id)
        return sorted(stops)

    def _generate_rows(self, prompts: list[list[int]], params: SamplingParams, seed: int | None) -> list[GenerationResult]:
        """One ``generate()`` over ``prompts`` (left-padded); each row cut at its stop or budget."""
        self._calls += 1
        budgets = [min(params.max_new_tokens, self.max_model_len - len(p)) for p in prompts]
        live = [i for i, b in enumerate(budgets) if b > 0]
        results = [GenerationResult(list(p), [], [], "truncated_prompt", policy_version=self.weights_version) for p in prompts]
        if not live:
            return results
        stops = self._stop_ids(params)
        width = max(len(prompts[i]) for i in live)
        input_ids_BL = torch.tensor([[self.pad_id] * (width - len(prompts[i])) + list(prompts[i]) for i in live])
        mask_BL = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in live])
        gen_config = self._generation_config(params, max(budgets[i] for i in live), stops)
        with self._lock, torch.no_grad(), torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(input_ids=input_ids_BL.to(self.device), attention_mask=mask_BL.to(self.device),
                                      generation_config=gen_config, tokenizer=self.tokenizer if params.stop else None)
            new_BN = out.sequences[:, width:].cpu()
            logprobs_BNV = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1).cpu()
        logprobs_BN = logprobs_BNV.gather(-1, new_BN[..., None])[..., 0]
        for row, i in enumerate(live):
            results[i] = self._cut(prompts[i], new_BN[row].tolist(), logprobs_BN[row].tolist(), budgets[i], set(stops), params.stop)
        return results

    def _cut(self, prompt: list[int], tokens: list[int], logprobs: list[float], budget: int, stops: set[int],
             stop_strings: tuple[str, ...]) -> GenerationResult:
        """The row up to its first stop token or stop string (kept in the tokens, dropped from the
        text), or its budget; what ``generate`` padded after a finished row is dropped."""
        end, reason, text_cut = min(budget, len(tokens)), "length", None
        for k in range(end):
            if tokens[k] in stops:
                end, reason = k + 1, "stop"
                break
            if stop_strings:
                text = self.tokenizer.decode(tokens[: k + 1], skip_special_tokens=True)
                hit = next((s for s in stop_strings if text.endswith(s)), None)
                if hit is not None:
                    end, reason, text_cut = k + 1, "stop", text[: -len(hit)]
                    break
        response = tokens[:end]
        text = text_cut if text_cut is not None else self.tokenizer.decode(response, skip_special_tokens=True)
        return GenerationResult(list(prompt), response, logprobs[:end], reason, text=text, policy_version=self.weights_version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationResult]]:
        """``params.n`` samples of each prompt, in prompt order; ``batch_rows`` rows per ``generate()`` call."""
        rows = [prompts[p] for p in range(len(prompts)) for _ in range(params.n)]
        flat: list[GenerationResult] = []
        step = self.config.batch_rows
        for call, start in enumerate(range(0, len(rows), step)):
            seed = None if params.seed is None else params.seed + 1_000_003 * call
            flat += self._generate_rows(rows[start : start + step], params, seed)
        return [flat[p * params.n : (p + 1) * params.n] for p in range(len(prompts))]

    def metrics(self) -> dict[str, float]:
        """Totals since the start, logged with each step's record (``rlcore.interfaces.GeneratorMetrics``)."""
        return {"generation/static_cache_calls": float(self._calls)}

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        (result,) = await asyncio.to_thread(self._generate_rows, [prompt_ids], params, params.seed)
        return result

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        out = []
        with self._lock, torch.no_grad():
            for seq in sequences:
                ids_T = torch.tensor(seq, device=self.device)
                logits_TV = self.model(input_ids=ids_T[None], use_cache=False).logits[0]
                out.append(token_logprobs(logits_TV, ids_T).cpu().tolist())
        return out

    # ---- refit -----------------------------------------------------------------------------
    def update_weights(self, chunks: Iterable[NamedTensors]) -> None:
        """Copy Hugging Face-named tensors into the model in place (tied names included)."""
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers())
        with self._lock, torch.no_grad():
            for chunk in chunks:
                for name, tensor in chunk:
                    if name not in targets:
                        raise KeyError(f"hf_static refit: the generation model has no tensor named {name!r}")
                    if tuple(tensor.shape) != tuple(targets[name].shape):
                        raise ValueError(f"hf_static refit: {name!r} has shape {list(tensor.shape)}, "
                                         f"the generation model's is {list(targets[name].shape)}")
                    targets[name].copy_(tensor.to(device=self.device, dtype=targets[name].dtype))
        self.weights_version += 1

    def sleep(self) -> None:
        pass  # the model stays where it is: nothing of it is freed while the trainer runs

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        self.model = None


def build(config: RunConfig, section_config: HFStaticGenerationConfig, placement: Placement) -> StaticCacheGenerator:
    """Factory registered as ``hf_static``: ``factory(config, section_config, placement) -> Generator``.
    Runs in the driver process, on the trainer's device when colocated."""
    if placement.device == "cuda" and not placement.colocated:
        raise ConfigError("policy.generation.colocated.enabled", "the hf_static generator runs in the driver process "
                          "and cannot take GPUs of its own; use colocated generation")
    if section_config.return_routed_experts:
        raise ConfigError("policy.generation.return_routed_experts", "the hf_static generator does not report MoE routing "
                          "(the vllm generator on CUDA does)")
    policy = config.policy
    return StaticCacheGenerator(policy.model_name, section_config, policy.max_total_sequence_length,
                                device="cuda" if placement.device == "cuda" else "cpu")
