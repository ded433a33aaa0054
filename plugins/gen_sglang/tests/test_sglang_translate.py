"""rlcore's sampling parameters to SGLang's dict, and SGLang's answers to rlcore's results.

The answers below have the shapes SGLang 0.5.17 builds (read from its source):
``TokenizerManager._handle_batch_output`` (``sglang/srt/managers/tokenizer_manager.py``) returns
``{"text", "output_ids", "meta_info"}`` for a finished, non-streamed request; ``meta_info`` has ``id``,
``finish_reason`` (``FINISH_MATCHED_TOKEN.to_json()`` = ``{"type": "stop", "matched": id}``,
``FINISH_LENGTH`` = ``{"type": "length", "length": n}``, ``FINISH_ABORT`` = ``{"type": "abort",
"message", "status_code", "err_type"}``, in ``managers/schedule_batch.py``), ``prompt_tokens``,
``weight_version``, ``num_retractions``, and with ``return_logprob`` the ``(logprob, token_id, None)``
tuples of ``detokenize_logprob_tokens`` in ``output_token_logprobs`` and ``input_token_logprobs``, the
latter starting with a None logprob (``scheduler_components/logprob_result_processor.py``).
"""

from __future__ import annotations

import importlib.util

import pytest

from rlcore.interfaces import GenerationResult, SamplingParams
from rlcore_sglang import translate


def answer(output_ids, logprobs, finish, *, text="", input_logprobs=(), retractions=0):
    return {"text": text, "output_ids": list(output_ids), "meta_info": {
        "id": "rid-0", "finish_reason": finish, "prompt_tokens": 3, "weight_version": "default",
        "num_retractions": retractions, "output_token_logprobs_length": len(logprobs),
        "output_token_logprobs": [(lp, tok, None) for lp, tok in zip(logprobs, output_ids)],
        "input_token_logprobs": list(input_logprobs),
    }}


def test_sampling_params_become_sglangs_fields():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64, n=4, stop=("</answer>",),
                            stop_token_ids=(5, 9), seed=3, ignore_eos=True)
    assert translate.sampling_dict(params, room=100) == {
        "max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "ignore_eos": True,
        "stop": ["</answer>"], "stop_token_ids": [5, 9]}


def test_sampling_params_clamp_to_the_room_left_and_keep_greedy_and_all_tokens():
    greedy = translate.sampling_dict(SamplingParams(temperature=0.0, max_new_tokens=64), room=10)
    # SGLang reads temperature 0 as greedy and top_k -1 as the whole vocabulary (SamplingParams.__post_init__)
    assert greedy == {"max_new_tokens": 10, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "ignore_eos": False}
    assert translate.sampling_dict(SamplingParams(max_new_tokens=64), room=0)["max_new_tokens"] == 1


def test_an_answer_stopped_by_a_token_becomes_a_result_with_the_stop_token_and_its_logprob():
    out = answer([7, 8, 2], [-0.5, -1.25, -0.125], {"type": "stop", "matched": 2}, text="ab")
    result = translate.to_result(out, [1, 2, 3], version=4)
    assert result == GenerationResult(prompt_ids=[1, 2, 3], response_ids=[7, 8, 2], response_logprobs=[-0.5, -1.25, -0.125],
                                      finish_reason="stop", text="ab", policy_version=4)


@pytest.mark.parametrize("finish, reason", [
    ({"type": "length", "length": 3}, "length"),
    ({"type": "stop", "matched": "</answer>"}, "stop"),
    ({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}, "abort"),
    (None, "abort"),
])
def test_finish_reasons(finish, reason):
    assert translate.to_result(answer([7, 8, 9], [-1.0, -2.0, -3.0], finish), [1], version=0).finish_reason == reason


def test_logprobs_of_other_tokens_than_the_sampled_ones_are_an_error():
    out = answer([7, 8, 9], [-1.0, -2.0, -3.0], {"type": "length", "length": 3})
    out["output_ids"] = [7, 8, 9, 10]
    with pytest.raises(RuntimeError, match=r"logprobs of 3 tokens for 4 sampled tokens \(first difference at 3\)"):
        translate.to_result(out, [1], version=0)
    del out["meta_info"]["output_token_logprobs"]
    with pytest.raises(RuntimeError, match="return_logprob=True"):
        translate.to_result(out, [1], version=0)


def test_prompt_logprobs_are_token_aligned_with_index_0_zero():
    out = answer([4], [-0.5], {"type": "length", "length": 1},
                 input_logprobs=[(None, 1, None), (-2.5, 2, None), (-0.75, 3, None)])
    assert translate.prompt_logprobs(out, [1, 2, 3], vocab_size=128) == [0.0, -2.5, -0.75]
    with pytest.raises(RuntimeError, match="3 prompt logprobs for a sequence of 4 tokens"):
        translate.prompt_logprobs(out, [1, 2, 3, 4], vocab_size=128)
    with pytest.raises(RuntimeError, match="first difference at 2"):
        translate.prompt_logprobs(out, [1, 2, 5], vocab_size=128)


def test_prompt_logprobs_read_the_models_last_token_as_sglang_reports_it():
    """SGLang reports input ids from vocab_size - 1 up as 0 (its image-token clipping): the last token id
    still matches, any other id in its place does not."""
    out = answer([4], [-0.5], {"type": "length", "length": 1},
                 input_logprobs=[(None, 1, None), (-2.5, 0, None), (-0.75, 3, None)])
    assert translate.prompt_logprobs(out, [1, 127, 3], vocab_size=128) == [0.0, -2.5, -0.75]
    with pytest.raises(RuntimeError, match="first difference at 1"):
        translate.prompt_logprobs(out, [1, 126, 3], vocab_size=128)


def test_retractions_are_summed_over_answers():
    outs = [answer([1], [-1.0], None, retractions=2), answer([1], [-1.0], None), answer([1], [-1.0], None, retractions=1)]
    assert translate.retractions(outs) == 3


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed (no CPU build on the "
                    "package index; the GPU check installs sglang 0.5.17: benchmarks/gpu/README.md)")
def test_sglang_accepts_the_sampling_dicts():
    from sglang.srt.sampling.sampling_params import TOP_K_ALL
    from sglang.srt.sampling.sampling_params import SamplingParams as SglangSamplingParams

    sampled = SglangSamplingParams(**translate.sampling_dict(
        SamplingParams(temperature=0.7, top_k=20, stop=("</answer>",), stop_token_ids=(5, 9)), room=100))
    sampled.verify(128)
    assert sampled.stop_strs == ["</answer>"] and sampled.stop_token_ids == {5, 9} and sampled.top_k == 20
    greedy = SglangSamplingParams(**translate.sampling_dict(SamplingParams(temperature=0.0), room=100))
    assert greedy.top_k == 1  # SGLang's greedy
    assert SglangSamplingParams(**translate.sampling_dict(SamplingParams(), room=100)).top_k == TOP_K_ALL
