"""A generator on a ``transformers`` model in this process: simple and exact.

For debugging, for runs where vLLM is not installed, and for fast tests of the run loop. It
keeps the policy in this process; refit copies Hugging Face-named tensors into it in place.
A batch of prompts is decoded together (left-padded, KV cache), one forward per new token for
all rows; each row samples with its own seed (when given), so a deterministic run repeats
exactly and a row draws what it would draw alone. Written here rather than through
``model.generate`` because that draws every row from one random stream and returns no per-token
logprobs of the sampling distribution.

Vision-language models (a config with a ``vision_config``: Qwen2.5-VL, Qwen3-VL, LLaVA) take prompts
with images (:class:`rlcore.interfaces.ImageGenerator`): the first forward gets the batch's
pixel values and, for Qwen-VL, each row's multimodal rotary positions
(:func:`rlcore.data.multimodal.mrope_positions`); each new token's position follows its row's last one.
The ``n`` samples of a prompt share its images object, which the vision tower encodes once
(:func:`rlcore.data.multimodal.encoding_shared_images_once`).
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Iterable

import torch

from rlcore.config import ConfigError
from rlcore.config.hf_generation import HFGenerationConfig
from rlcore.interfaces import GenerationResult, NamedTensors, Placement, SamplingParams
from rlcore.data.multimodal import (ImageInputs, encoding_shared_images_once, is_vision_language, mrope_positions,
                               uses_multimodal_rope)
from rlcore.utils import torch_dtype


class HFGenerator:
    BATCH_ROWS = 256  # sequences decoded together: the demo's whole step (16 prompts x 8) in one batch

    def __init__(self, model_dir: str, config: HFGenerationConfig, max_model_len: int, device: str = "cpu"):
        """``device``: where the model runs (:func:`build` gives the run's: ``cuda`` on a GPU run, where
        generation is colocated with the trainer)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        self.config = config
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        hf_config = AutoConfig.from_pretrained(model_dir)
        self.vision = is_vision_language(hf_config)
        loader = AutoModelForImageTextToText if self.vision else AutoModelForCausalLM
        self.model = loader.from_pretrained(model_dir, dtype=torch_dtype(config.dtype)).to(self.device).eval()
        self.image_token = int(hf_config.image_token_id) if self.vision else -1
        self.mrope = self.vision and uses_multimodal_rope(self.model)
        # The vision placeholders are never text a model writes: a response holding one would not match
        # its images in the trainer's forward. Left out of sampling (their logits set to -inf).
        self.never_sample = ([int(getattr(hf_config, k)) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")
                              if getattr(hf_config, k, None) is not None] if self.vision else [])
        self.max_model_len = max_model_len
        self.weights_version = 0
        # Sampling reads the last position's logits only: asking the model for those alone keeps the
        # prefill's [rows, prompt, vocab] logits (gigabytes at a 150k vocabulary) from being made.
        self.last_logits_only = ({"logits_to_keep": 1}
                                 if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {})

    def _sample_one(self, prompt_ids: list[int], params: SamplingParams, seed: int | None) -> GenerationResult:
        return self._sample_batch([prompt_ids], params, [seed])[0]

    def _sample_batch(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int | None],
                      images: list[ImageInputs | None] | None = None) -> list[GenerationResult]:
        """Every prompt decoded together: left-padded, one forward over the whole batch per new token,
        KV cache kept. Each row samples with its own seeded generator, so a row draws the same tokens
        as it would alone (up to the batch's float rounding). ``images[r]``: row r's prompt images."""
        stops = set(params.stop_token_ids) | set(self.config.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stops.add(self.tokenizer.eos_token_id)
        rows = len(prompts)
        lengths = [len(p) for p in prompts]
        budgets = [max(0, min(params.max_new_tokens, self.max_model_len - n)) for n in lengths]
        # On the model's device: a row's noise is a whole vocabulary of uniforms a token, and drawing
        # those on the host for a GPU model cost more than its forward (128 rows x 152k: ~0.2 s a token).
        generators = [torch.Generator(device=self.device).manual_seed(s) if s is not None else None for s in seeds]
        responses: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        finish = ["length"] * rows
        live = [b > 0 for b in budgets]
        width = max(lengths)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        inputs = torch.tensor([[pad] * (width - n) + list(p) for p, n in zip(prompts, lengths)], device=self.device)
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        vision: dict = {}
        next_position = torch.tensor(lengths, device=self.device)  # of each row's first new token
        mrope = images is not None and self.mrope
        if images is not None:
            if mrope:
                positions, next_position = self._mrope_rows(prompts, images, width)
            batch_images = ImageInputs.concat(images)
            if batch_images is not None:
                vision = batch_images.to(self.device).model_inputs(self.model.dtype)
        past = None
        with torch.no_grad():
            for step in range(max(budgets, default=0)):
                if not any(live):
                    break
                # the images enter with the prompt (step 0); a prompt's n samples share one images object
                with encoding_shared_images_once(self.model, images if step == 0 else None, self.device):
                    out = self.model(input_ids=inputs, attention_mask=mask, position_ids=positions, past_key_values=past,
                                     use_cache=True, **self.last_logits_only, **(vision if step == 0 else {}))
                past = out.past_key_values
                logits_BV = out.logits[:, -1].float()
                if self.never_sample:
                    logits_BV[:, self.never_sample] = float("-inf")
                tokens, token_logprobs = self._pick(logits_BV, params, generators)
                next_tokens = []
                for r in range(rows):
                    if not live[r]:
                        next_tokens.append(pad)
                        continue
                    token = tokens[r]
                    responses[r].append(token)
                    logprobs[r].append(token_logprobs[r])
                    next_tokens.append(token)
                    if token in stops or (params.stop and any(self.tokenizer.decode(responses[r]).endswith(x) for x in params.stop)):
                        finish[r], live[r] = "stop", False
                    elif len(responses[r]) >= budgets[r]:
                        live[r] = False
                inputs = torch.tensor(next_tokens, device=self.device)[:, None]
                mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=self.device)], dim=1)
                positions = (next_position + step)[:, None]
                if mrope:
                    positions = positions[None].expand(3, -1, -1)
        return [GenerationResult(list(prompt), response, lps, reason, policy_version=self.weights_version,
                                 text=self.tokenizer.decode(response, skip_special_tokens=True))
                for prompt, response, lps, reason in zip(prompts, responses, logprobs, finish)]

    def _mrope_rows(self, prompts: list[list[int]], images: list[ImageInputs | None], width: int):
        """Left-padded multimodal positions [3, rows, width] and each row's next position [rows]."""
        positions = torch.zeros(3, len(prompts), width, dtype=torch.long, device=self.device)
        following = []
        for r, (prompt, row_images) in enumerate(zip(prompts, images)):
            ids_L = torch.tensor(prompt, device=self.device)
            row_3L = mrope_positions(self.model, ids_L, row_images, self.image_token)
            positions[:, r, width - len(prompt) :] = row_3L
            following.append(int(row_3L.max()) + 1)
        return positions, torch.tensor(following, device=self.device)

    @staticmethod
    def _pick(logits_BV: torch.Tensor, params: SamplingParams, generators: list) -> tuple[list[int], list[float]]:
        """One token per row and its logprob under the sampling distribution (temperature, top-k,
        top-p applied). Sampling is Gumbel-max with each row's noise drawn from its own generator
        (the device's global one for unseeded rows), on the logits' device, so a seeded row repeats on
        the same kind of device: ``argmax(log p + g)``, g = -log(-log u), is a draw from p."""
        if params.temperature <= 0:
            logprobs_BV = torch.log_softmax(logits_BV, -1)
            tokens_B = logits_BV.argmax(-1)
        else:
            scaled_BV = logits_BV / params.temperature
            if params.top_k > 0:
                kth_B1 = torch.topk(scaled_BV, min(params.top_k, scaled_BV.shape[-1]), dim=-1).values[:, -1:]
                scaled_BV = scaled_BV.masked_fill(scaled_BV < kth_B1, float("-inf"))
            if params.top_p < 1.0:
                sorted_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True)
                probs_BV = torch.softmax(sorted_BV, -1)
                drop_BV = probs_BV.cumsum(-1) - probs_BV > params.top_p
                scaled_BV = scaled_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
            logprobs_BV = torch.log_softmax(scaled_BV, -1)
            vocab = logits_BV.shape[-1]
            device = logprobs_BV.device
            uniform_BV = torch.stack([torch.rand(vocab, generator=g, device=device) for g in generators]).clamp_(1e-20, 1.0)
            tokens_B = (logprobs_BV - torch.log(-torch.log(uniform_BV))).argmax(-1)
        chosen_B = logprobs_BV.gather(-1, tokens_B[:, None])[:, 0]
        return tokens_B.tolist(), chosen_B.tolist()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationResult]]:
        """``params.n`` samples of each prompt, decoded in batches of at most ``BATCH_ROWS`` rows."""
        rows = [(p, k) for p in range(len(prompts)) for k in range(params.n)]
        seeds = [None if params.seed is None else params.seed + 1_000_003 * p + k for p, k in rows]
        flat: list[GenerationResult] = []
        for start in range(0, len(rows), self.BATCH_ROWS):
            part = rows[start : start + self.BATCH_ROWS]
            flat += self._sample_batch([prompts[p] for p, _ in part], params, seeds[start : start + self.BATCH_ROWS])
        return [flat[p * params.n : (p + 1) * params.n] for p in range(len(prompts))]

    def generate_with_images(self, prompts: list[list[int]], images: list[ImageInputs | None],
                             params: SamplingParams) -> list[list[GenerationResult]]:
        """:meth:`generate` with each prompt's images (a vision-language model)."""
        if not self.vision:
            raise ValueError("the hf generator's model has no vision tower; it cannot take prompts with images")
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} images entries")
        rows = [(p, k) for p in range(len(prompts)) for k in range(params.n)]
        seeds = [None if params.seed is None else params.seed + 1_000_003 * p + k for p, k in rows]
        flat: list[GenerationResult] = []
        for start in range(0, len(rows), self.BATCH_ROWS):
            part = rows[start : start + self.BATCH_ROWS]
            flat += self._sample_batch([prompts[p] for p, _ in part], params, seeds[start : start + self.BATCH_ROWS],
                                       images=[images[p] for p, _ in part])
        return [flat[p * params.n : (p + 1) * params.n] for p in range(len(prompts))]

    def score_with_images(self, sequences: list[list[int]], images: list[ImageInputs | None]) -> list[list[float]]:
        from rlcore.training.ops import token_logprobs

        out = []
        with torch.no_grad():
            for seq, seq_images in zip(sequences, images):
                ids_T = torch.tensor(seq, device=self.device)
                extra: dict = {}
                if self.mrope:
                    extra["position_ids"] = mrope_positions(self.model, ids_T, seq_images, self.image_token)[:, None]
                if seq_images is not None:
                    extra.update(seq_images.to(self.device).model_inputs(self.model.dtype))
                logits_TV = self.model(input_ids=ids_T[None], **extra).logits[0]
                out.append(token_logprobs(logits_TV, ids_T).tolist())
        return out

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        return await asyncio.to_thread(self._sample_one, prompt_ids, params, params.seed)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        from rlcore.training.ops import token_logprobs

        out = []
        with torch.no_grad():
            for seq in sequences:
                ids_T = torch.tensor(seq, device=self.device)
                logits_TV = self.model(input_ids=ids_T[None]).logits[0]
                out.append(token_logprobs(logits_TV, ids_T).tolist())
        return out

    def update_weights(self, chunks: Iterable[NamedTensors]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        if self.vision:
            params.update(_checkpoint_names(self.model))
        with torch.no_grad():
            for chunk in chunks:
                for name, tensor in chunk:
                    target = params.get(name)
                    if target is None:
                        target = _fused_expert_slice(params, name)
                    if target is None:
                        raise KeyError(f"refit: the generator's model has no tensor named {name!r}")
                    target.copy_(tensor.to(target.dtype))
        self.weights_version += 1

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _checkpoint_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under their checkpoint names where those differ from the in-memory
    ones (Qwen2.5-VL: ``visual.*`` and ``model.layers.*`` for ``model.visual.*`` and
    ``model.language_model.layers.*``): refits stream checkpoint names."""
    from transformers.core_model_loading import revert_weight_conversion

    out = {}
    for name, param in model.named_parameters():
        names = list(revert_weight_conversion(model, {name: param}))
        if len(names) == 1:
            out[names[0]] = param
    return out


_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused_expert_slice(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of transformers' fused MoE parameter that a checkpoint-named expert weight is
    (refits stream checkpoint names, as vLLM takes them): ``experts.gate_up_proj[e]`` is
    ``[gate_proj; up_proj]`` of expert e, ``experts.down_proj[e]`` its ``down_proj``."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
    if kind == "down_proj":
        fused = params.get(f"{prefix}.down_proj")
        return None if fused is None else fused[expert]
    fused = params.get(f"{prefix}.gate_up_proj")
    if fused is None:
        return None
    half = fused.shape[1] // 2
    return fused[expert, :half] if kind == "gate_proj" else fused[expert, half:]


def build(config, section_config: HFGenerationConfig, placement: Placement) -> HFGenerator:
    """Runs in the driver process, on the run's device: the trainer's GPU when colocated on one (as the
    vllm generator does), else the CPU."""
    if not placement.colocated and placement.device == "cuda":
        raise ConfigError("policy.generation.colocated.enabled", "the hf generator runs in the driver process "
                          "and cannot take GPUs of its own; use colocated generation or the vllm generator")
    if section_config.return_routed_experts:
        raise ConfigError("policy.generation.return_routed_experts", "the hf generator does not report MoE routing "
                          "(the vllm generator on CUDA does)")
    policy = config.policy
    return HFGenerator(policy.model_name, section_config, policy.max_total_sequence_length, device=placement.device)
