"""A generator built on ``transformers``' own ``generate``: slow, simple and exact.

For debugging, for runs where vLLM is not installed, and for fast tests of the run loop. It
keeps the policy in this process; refit copies Hugging Face-named tensors into it in place.
Sampling uses a per-request seed (when given) so that a deterministic run repeats exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import torch

from rlcore.config import ConfigError
from rlcore.config.hf_generation import HFGenerationConfig
from rlcore.interfaces import GenerationResult, NamedTensors, Placement, SamplingParams
from rlcore.utils import torch_dtype


class HFGenerator:
    def __init__(self, model_dir: str, config: HFGenerationConfig, max_model_len: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(config.dtype)).eval()
        self.max_model_len = max_model_len
        self.weights_version = 0

    def _sample_one(self, prompt_ids: list[int], params: SamplingParams, seed: int | None) -> GenerationResult:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        stops = set(params.stop_token_ids) | set(self.config.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stops.add(self.tokenizer.eos_token_id)
        ids = list(prompt_ids)
        response, logprobs, finish = [], [], "length"
        past = None
        inputs = torch.tensor([ids])
        budget = min(params.max_new_tokens, self.max_model_len - len(ids))
        with torch.no_grad():
            for _ in range(max(0, budget)):
                out = self.model(input_ids=inputs, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits_V = out.logits[0, -1].float()
                token, logprob = self._pick(logits_V, params, generator)
                response.append(token)
                logprobs.append(logprob)
                inputs = torch.tensor([[token]])
                if token in stops:
                    finish = "stop"
                    break
                if params.stop and any(self.tokenizer.decode(response).endswith(s) for s in params.stop):
                    finish = "stop"
                    break
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        return GenerationResult(list(prompt_ids), response, logprobs, finish, text=text, policy_version=self.weights_version)

    @staticmethod
    def _pick(logits_V: torch.Tensor, params: SamplingParams, generator) -> tuple[int, float]:
        if params.temperature <= 0:
            logprobs_V = torch.log_softmax(logits_V, -1)
            token = int(torch.argmax(logits_V))
            return token, float(logprobs_V[token])
        scaled_V = logits_V / params.temperature
        if params.top_k > 0:
            kth = torch.topk(scaled_V, min(params.top_k, scaled_V.numel())).values[-1]
            scaled_V = scaled_V.masked_fill(scaled_V < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_V, order = torch.sort(scaled_V, descending=True)
            cumulative = torch.softmax(sorted_V, -1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_V, -1) > params.top_p
            scaled_V = scaled_V.scatter(0, order[drop], float("-inf"))
        logprobs_V = torch.log_softmax(scaled_V, -1)
        token = int(torch.multinomial(logprobs_V.exp(), 1, generator=generator))
        return token, float(logprobs_V[token])

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationResult]]:
        results = []
        for p, prompt in enumerate(prompts):
            per_prompt = []
            for k in range(params.n):
                seed = None if params.seed is None else params.seed + 1_000_003 * p + k
                per_prompt.append(self._sample_one(prompt, params, seed))
            results.append(per_prompt)
        return results

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        return await asyncio.to_thread(self._sample_one, prompt_ids, params, params.seed)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        from rlcore.ops import token_logprobs

        out = []
        with torch.no_grad():
            for seq in sequences:
                ids_T = torch.tensor(seq)
                logits_TV = self.model(input_ids=ids_T[None]).logits[0]
                out.append(token_logprobs(logits_TV, ids_T).tolist())
        return out

    def update_weights(self, chunks: Iterable[NamedTensors]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        with torch.no_grad():
            for chunk in chunks:
                for name, tensor in chunk:
                    if name not in params:
                        raise KeyError(f"refit: the generator's model has no tensor named {name!r}")
                    params[name].copy_(tensor.to(params[name].dtype))
        self.weights_version += 1

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def build(config, section_config: HFGenerationConfig, placement: Placement) -> HFGenerator:
    """Runs in the driver process, on the CPU."""
    if not placement.colocated and placement.device == "cuda":
        raise ConfigError("policy.generation.colocated.enabled", "the hf generator runs in the driver process "
                          "and cannot take GPUs of its own; use colocated generation or the vllm generator")
    policy = config.policy
    return HFGenerator(policy.model_name, section_config, policy.max_total_sequence_length)
