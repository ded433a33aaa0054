"""rlcore's requests to SGLang's and SGLang's answers to rlcore's: pure functions on plain data.

What they are written against (SGLang 0.5.17):

- a request's ``sampling_params`` is a dict of ``sglang/srt/sampling/sampling_params.py``'s
  ``SamplingParams`` fields (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``,
  ``stop_token_ids``, ``ignore_eos``, ...); temperature 0 is greedy there (it becomes ``top_k=1``);
- an answer (``TokenizerManager._handle_batch_output`` in ``managers/tokenizer_manager.py``) is a dict
  ``{"text", "output_ids", "meta_info"}``; with ``return_logprob`` the ``meta_info`` holds
  ``output_token_logprobs`` and ``input_token_logprobs``, lists of ``(logprob, token_id, text)``
  tuples (``detokenize_logprob_tokens``: text None unless asked for), the first input entry's logprob
  None (``scheduler_components/logprob_result_processor.py``: "add None at start");
  ``finish_reason`` is None or a dict whose ``type`` is ``"stop"``, ``"length"`` or ``"abort"``
  (``FINISH_*.to_json`` in ``managers/schedule_batch.py``); ``num_retractions`` counts the times the
  scheduler took the request's KV cache back to make room (and recomputed it later).

``output_ids`` are the sampled tokens as the model produced them, a stop token included (the
detokenizer trims a matched stop from the text only).
"""

from __future__ import annotations

from typing import Any

from rlcore.interfaces import GenerationResult, SamplingParams

FINISH_REASONS = ("stop", "length", "abort")


def sampling_dict(params: SamplingParams, *, room: int) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for one request; ``room`` is what the context leaves after the prompt.

    No per-request seed: SGLang honours ``sampling_seed`` only in its deterministic-inference mode, where
    the n copies of a prompt (one seed, same positions) would draw the same tokens; the engine's
    ``random_seed`` seeds the sampling instead."""
    out: dict[str, Any] = {
        "max_new_tokens": max(1, min(params.max_new_tokens, room)),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "ignore_eos": bool(params.ignore_eos),
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    return out


def finish_reason(meta_info: dict[str, Any]) -> str:
    """rlcore's finish reason from SGLang's ``meta_info["finish_reason"]`` (None: the request never finished)."""
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in FINISH_REASONS else "abort"


def sampled_logprobs(meta_info: dict[str, Any], output_ids: list[int]) -> list[float]:
    """The logprob of each sampled token, checked against the token ids SGLang reports beside them."""
    entries = meta_info.get("output_token_logprobs")
    if entries is None:
        raise RuntimeError("SGLang returned no output_token_logprobs (the request must set return_logprob=True)")
    ids = [int(e[1]) for e in entries]
    if ids != list(output_ids):
        raise RuntimeError(f"SGLang returned logprobs of {len(ids)} tokens for {len(output_ids)} sampled tokens "
                           f"(first difference at {_first_difference(ids, list(output_ids))})")
    return [float(e[0]) for e in entries]


def to_result(output: dict[str, Any], prompt_ids: list[int], version: int) -> GenerationResult:
    """One SGLang answer as a :class:`GenerationResult` (``prompt_ids`` as sent)."""
    meta = output["meta_info"]
    response = [int(t) for t in output["output_ids"]]
    return GenerationResult(
        prompt_ids=list(prompt_ids), response_ids=response, response_logprobs=sampled_logprobs(meta, response),
        finish_reason=finish_reason(meta), text=output.get("text") or "", policy_version=version,
    )


def prompt_logprobs(output: dict[str, Any], sequence: list[int], vocab_size: int) -> list[float]:
    """Token-aligned logprobs of ``sequence`` (index 0 is 0) from an answer requested with
    ``return_logprob=True, logprob_start_len=0``, checked against the token ids SGLang reports beside them.

    SGLang reports an input id of ``vocab_size - 1`` or more as 0 (it clips image tokens' padded hash values
    there: ``scheduler_components/logprob_result_processor.py``), so the sequence is compared clipped the same
    way: the model's last token id is a real token a sequence may hold."""
    entries = output["meta_info"].get("input_token_logprobs")
    if entries is None or len(entries) != len(sequence):
        got = "none" if entries is None else len(entries)
        raise RuntimeError(f"SGLang returned {got} prompt logprobs for a sequence of {len(sequence)} tokens")
    ids = [int(e[1]) for e in entries]
    expected = [t if t < vocab_size - 1 else 0 for t in sequence]
    if ids != expected:
        raise RuntimeError(f"SGLang scored other tokens than the sequence's (first difference at {_first_difference(ids, expected)})")
    return [0.0] + [float(e[0]) for e in entries[1:]]


def retractions(outputs: list[dict[str, Any]]) -> int:
    """How often the scheduler took these requests' KV cache back (``meta_info["num_retractions"]``)."""
    return sum(int(o["meta_info"].get("num_retractions") or 0) for o in outputs)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
