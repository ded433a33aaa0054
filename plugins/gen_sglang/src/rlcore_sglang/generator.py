"""The ``sglang`` generator: rollouts, scoring and in-place weight updates on SGLang's offline engine.

Tokens in, tokens out: prompts go to SGLang as ``input_ids`` and results carry its ``output_ids`` with
the engine's logprob of each. The logprobs are of the model's own distribution (temperature 1, before
top-k / top-p), which is what the trainer computes and what the ``vllm`` generator returns: SGLang's
sampler returns them with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set (``sglang/srt/layers/sampler.py``;
without it, the logprobs of the temperature-scaled distribution). The tokenizer stays in SGLang's
engine (no ``skip_tokenizer_init``): its stop strings and response text need it.

Prompts longer than ``max_model_len - 1`` follow ``prompt_overflow`` (``truncate`` keeps their last
tokens, ``drop`` returns empty responses with ``finish_reason="truncated_prompt"``), counted in
:meth:`SglangGenerator.metrics`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from rlcore.config import ConfigError
from rlcore.interfaces import GenerationResult, NamedTensors, Placement, SamplingParams
from rlcore.data.prompts import answers_in_order, fit_to_context
from rlcore.generation.staged_wake import StagedWake
from rlcore_sglang import translate
from rlcore_sglang.config import SglangConfig

def server_args(config: SglangConfig, model_path: str, *, tokenizer_path: str | None, max_model_len: int, dtype: str,
                seed: int, memory_fraction: float) -> dict[str, Any]:
    """``Engine(**kwargs)``: fields of ``sglang/srt/server_args.py``'s ``ServerArgs``."""
    sleep_level = config.colocated.sleep_level if config.colocated.enabled else 0
    args: dict[str, Any] = dict(
        model_path=model_path, tokenizer_path=tokenizer_path or model_path, dtype=dtype, random_seed=seed,
        context_length=max_model_len, tp_size=config.tp_size, mem_fraction_static=memory_fraction,
        disable_cuda_graph=config.enforce_eager, disable_radix_cache=not config.enable_prefix_caching,
        # The memory saver (torch_memory_saver) is what release/resume_memory_occupation act on.
        enable_memory_saver=sleep_level > 0, enable_weights_cpu_backup=sleep_level == 1,
        log_level=config.log_level,
    )
    if config.max_running_requests is not None:
        args["max_running_requests"] = config.max_running_requests
    return args


def _vocab_size(model_path: str) -> int:
    """The model's vocabulary size as SGLang reads it (the text model's, for a vision-language model)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).get_text_config().vocab_size)


class SglangGenerator(StagedWake):
    """A :class:`rlcore.interfaces.Generator` (and :class:`rlcore.interfaces.GeneratorMetrics`) on one SGLang engine."""

    ENGINE_NAME = "SGLang"

    def __init__(self, model_path: str, config: SglangConfig | None = None, *, max_model_len: int = 1024,
                 dtype: str = "bfloat16", seed: int = 0, tokenizer_path: str | None = None,
                 memory_fraction: float | None = None, engine_kwargs: dict[str, Any] | None = None):
        from rlcore_sglang.engine import EngineThread

        self.config = config or SglangConfig()
        self.model_path = str(model_path)
        self.max_model_len = self.config.max_model_len or max_model_len
        self.dtype = dtype  # the engine's, which refits are sent in
        self.vocab_size = _vocab_size(self.model_path)
        self.weights_version = 0
        self.sleeping = False
        self._start_staged_wake()
        self._metrics = {"generation/truncated_prompts": 0.0, "generation/dropped_prompts": 0.0,
                         "generation/retractions": 0.0}
        self.memory_fraction = self.config.engine_memory_fraction(memory_fraction)
        args = server_args(self.config, self.model_path, tokenizer_path=tokenizer_path, max_model_len=self.max_model_len,
                           dtype=dtype, seed=seed, memory_fraction=self.memory_fraction)
        args.update(engine_kwargs or {})
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # read by the engine's processes as they start
        self.engine = EngineThread(args)

    # ---- sampling ------------------------------------------------------------------------------
    def _fit_prompt(self, prompt_ids: list[int]) -> list[int] | None:
        """The prompt as it will be sent, or None when the overflow policy drops it (counted in :meth:`metrics`)."""
        fitted, outcome = fit_to_context(prompt_ids, self.max_model_len, self.config.prompt_overflow)
        if outcome is not None:
            self._metrics[f"generation/{outcome}_prompts"] += 1
        return fitted

    async def _request(self, prompts: list[list[int]], sampling: list[dict[str, Any]], **logprob_args) -> list[dict]:
        """One batch through the tokenizer manager, on the engine's loop; answers in request order."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        if not prompts:
            return []
        request = GenerateReqInput(input_ids=prompts, sampling_params=sampling, return_logprob=True, **logprob_args)
        outputs = await self.engine.manager.generate_request(request, None).__anext__()
        outputs = outputs if isinstance(outputs, list) else [outputs]
        self._metrics["generation/retractions"] += translate.retractions(outputs)
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationResult]]:
        self._check_awake()
        version = self.weights_version  # the weights these samples come from (a refit may follow)
        fitted = [self._fit_prompt(p) for p in prompts]
        # n samples of a prompt are n requests of one batch: the radix cache shares their prefix.
        sent = [p for p in fitted if p is not None for _ in range(params.n)]
        sampling = [translate.sampling_dict(params, room=self.max_model_len - len(p)) for p in sent]
        outputs = iter(self.engine.call(self._request(sent, sampling)))
        return answers_in_order(prompts, fitted, params.n, version,
                                lambda p: [translate.to_result(next(outputs), p, version) for _ in range(params.n)])

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        self._check_awake()
        version = self.weights_version
        fitted = self._fit_prompt(prompt_ids)
        if fitted is None:
            return GenerationResult.dropped(prompt_ids, self.weights_version)
        sampling = translate.sampling_dict(params, room=self.max_model_len - len(fitted))
        outputs = await self.engine.acall(self._request([fitted], [sampling]))
        return translate.to_result(outputs[0], fitted, version)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Token-aligned logprobs of each sequence under the engine's weights (SGLang's input logprobs)."""
        self._check_awake()
        for i, seq in enumerate(sequences):
            if not 2 <= len(seq) <= self.max_model_len - 1:
                raise ValueError(f"score: sequence {i} has {len(seq)} tokens; need 2..{self.max_model_len - 1}")
        sent = [list(s) for s in sequences]
        one_token = [{"max_new_tokens": 1, "temperature": 1.0} for _ in sent]
        outputs = self.engine.call(self._request(sent, one_token, logprob_start_len=0))
        return [translate.prompt_logprobs(out, seq, self.vocab_size) for out, seq in zip(outputs, sent)]

    # ---- weights -------------------------------------------------------------------------------
    def update_weights(self, chunks: Iterable[NamedTensors]) -> None:
        """Load Hugging Face-named chunks in place: one SGLang ``update_weights_from_tensor`` per chunk, then
        the radix cache flushed (its KV was computed with the old weights) and the KV cache woken.

        A failure part-way re-raises without bumping ``weights_version`` (the layers loaded before it keep
        the new weights: the run loop's refit probe would flag the mix if the error were swallowed)."""
        from rlcore_sglang.weights import bucket_payload, by_dtype, send_bucket

        if self.sleeping:
            self.wake_up()
        manager = self.engine.manager
        keep = []  # see rlcore_sglang.weights: alive until the engine has flushed after the last chunk
        try:
            for i, chunk in enumerate(chunks):
                for named in by_dtype(chunk):
                    payloads, buffer = bucket_payload(named, self.config.tp_size)
                    keep.append(buffer)
                    self.engine.call(send_bucket(manager, payloads, f"chunk {i} ({named[0][0]}, ...)"))
            self.engine.call(manager.flush_cache())
        finally:
            keep.clear()
        self.weights_version += 1
        self._wake_cache()  # the chunks are gone: the KV cache takes their memory

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def _sleeps(self) -> bool:
        """Whether the engine gives its memory back while the trainer works (colocated, sleep_level > 0)."""
        return self.config.colocated.enabled and self.config.colocated.sleep_level > 0

    def sleep(self) -> None:
        """Release the weights and the KV cache (see ``_sleeps``), measuring what the GPU got back; otherwise
        only marks the engine asleep, so that generating before ``wake_up`` fails the same way on every placement."""
        if self._sleeps and not self.sleeping:
            if self._cache_asleep:
                # A wake-up that no refit or generation followed left the KV cache released (SGLang's tags are
                # independent, and resuming one that is not released fails: offload_tags.remove).
                self._wake_bytes = self._cache_bytes + self._released_bytes(lambda: self._memory("release", ["weights"]))
            else:
                self._wake_bytes = self._released_bytes(lambda: self._memory("release", ["weights", "kv_cache"]))
            self._cache_asleep = True
        self.sleeping = True

    def _resume(self, tags: list[str]) -> None:
        self._memory("resume", tags)  # SGLang's tags are independent: weights before a refit, the KV cache after it

    def _memory(self, action: str, tags: list[str]) -> None:
        from sglang.srt.managers import io_struct

        manager = self.engine.manager
        if action == "release":
            self.engine.call(manager.release_memory_occupation(io_struct.ReleaseMemoryOccupationReqInput(tags=tags), None))
        else:
            self.engine.call(manager.resume_memory_occupation(io_struct.ResumeMemoryOccupationReqInput(tags=tags), None))

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def shutdown(self) -> None:
        """Shut the engine down awake where it sleeps and the GPU has room (the run shuts the trainer down first,
        so its memory is back): see :meth:`~rlcore.generation.staged_wake.StagedWake.wake_to_end`."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            self.wake_to_end()
            self.engine = None
            engine.shutdown()


def factory(config, section_config: SglangConfig, placement: Placement) -> SglangGenerator:
    """``factory(RunConfig, SglangConfig, Placement)``: the engine on this process's GPU; without
    colocation, on ``placement.generator_gpus``."""
    from rlcore_sglang.engine import require_sglang

    if placement.device != "cuda":
        raise ConfigError("policy.generation.backend", "'sglang' runs on CUDA GPUs only (SGLang has no CPU build on the "
                          "package index): set cluster.gpus_per_node, or use backend: vllm or hf on CPU")
    require_sglang()
    policy = config.policy
    dtype = policy.precision if section_config.dtype == "auto" else section_config.dtype
    seed = section_config.seed if section_config.seed is not None else config.train.seed
    if not placement.colocated and placement.generator_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(placement.generator_gpus)
    return SglangGenerator(
        policy.model_name, section_config, max_model_len=policy.max_total_sequence_length, dtype=dtype, seed=seed,
        tokenizer_path=policy.tokenizer_name, memory_fraction=placement.engine_memory_fraction,
    )
