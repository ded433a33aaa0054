"""On a CUDA GPU with SGLang 0.5.17: rlcore's generator conformance suite for ``sglang`` (built through
its registration, as a run builds it), then what the suite does not reach: logprobs against a Hugging
Face forward at temperature 1 and below, a refit through the plugin's transport, sleep and wake-up with
the memory given back (and a wake-up refused without room), and ``agenerate`` from several event loops. One engine for the module.

Skipped without SGLang or a GPU, with the reason: SGLang has no CPU build on the package index.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading

import pytest

from rlcore.interfaces import SamplingParams
from rlcore.testing.conformance import GeneratorConformance

from _sglang_helpers import build_generator


def _why_skip() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return ("sglang is not installed: SGLang has no CPU build on the package index; the GPU check installs "
                "sglang 0.5.17 and runs this module (benchmarks/gpu/README.md)")
    import torch

    if not torch.cuda.is_available():
        return "SGLang needs a CUDA GPU"
    return None


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or "")

# bf16 engine against an fp32 forward of the same bf16-rounded weights: bf16 activations (8-bit mantissa)
# through the tiny model's 2 layers move a logprob by ~1e-2 at most; a wrong token alignment or a
# temperature-scaled distribution moves it by ~0.1-1.
BF16_ATOL = 5e-2


@pytest.fixture(scope="module")
def sglang_generator(sglang_plugin_manager, tiny_model_dir):
    gen = build_generator(sglang_plugin_manager, tiny_model_dir, dtype="bfloat16", enforce_eager=True,
                          gpu_memory_utilization=0.3, refit={"chunk_bytes": 64 << 10})  # layers split across chunks
    yield gen
    gen.shutdown()


class TestSglangConformance(GeneratorConformance):
    @pytest.fixture
    def generator(self, sglang_generator):
        return sglang_generator

    @pytest.fixture
    def generator_model_dir(self, tiny_model_dir):
        return tiny_model_dir


@pytest.fixture(scope="module")
def hf_state(tiny_model_dir):
    """The checkpoint's tensors rounded to bf16 (what the engine holds), in fp32."""
    import torch

    from rlcore.testing.conformance import checkpoint_tensors

    return {n: t.to(torch.bfloat16).float() for n, t in checkpoint_tensors(tiny_model_dir).items()}


def _hf_logprobs(model_dir, state, sequences, temperature: float = 1.0):
    """Token-aligned logprobs of ``sequences`` under a transformers fp32 forward of ``state``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state)
    out = []
    with torch.no_grad():
        for seq in sequences:
            x = torch.tensor([seq])
            lp = torch.log_softmax(model(x).logits[0].float() / temperature, -1)[:-1].gather(-1, x[0, 1:, None])[:, 0]
            out.append([0.0] + lp.tolist())
    return out


def _gaps(results, reference):
    return [abs(a - b) for r, ref in zip(results, reference) for a, b in zip(r.response_logprobs, ref[len(r.prompt_ids):])]


def test_sampled_logprobs_are_the_models_own_at_any_temperature(sglang_generator, tiny_model_dir, hf_state):
    """At temperature 0.5, with the output layer sharpened (through a one-tensor refit) so that the
    temperature matters, the engine's logprobs are the model's own distribution's, as the trainer
    computes them (SGLANG_RETURN_ORIGINAL_LOGPROB), not the temperature-scaled one's."""
    sharp = {**hf_state, "lm_head.weight": hf_state["lm_head.weight"] * 8}
    prompts = [[1, 5, 9, 13], [2, 4, 6], [7, 7, 7, 7, 7]]
    sglang_generator.update_weights(iter([[("lm_head.weight", sharp["lm_head.weight"])]]))
    try:
        results = [r for per in sglang_generator.generate(prompts, SamplingParams(temperature=0.5, max_new_tokens=12, n=2))
                   for r in per]
        sequences = [r.prompt_ids + r.response_ids for r in results]
        own = _gaps(results, _hf_logprobs(tiny_model_dir, sharp, sequences))
        scaled = _gaps(results, _hf_logprobs(tiny_model_dir, sharp, sequences, temperature=0.5))
        assert max(own) < BF16_ATOL, f"engine vs the model's own logprobs: max gap {max(own)}"
        assert sum(scaled) / len(scaled) > 4 * BF16_ATOL, "the check cannot tell the two distributions apart"
    finally:
        sglang_generator.update_weights(iter([[("lm_head.weight", hf_state["lm_head.weight"])]]))


def test_refit_through_the_plugins_transport_in_the_engines_dtype(sglang_plugin_manager, sglang_generator, tiny_model_dir,
                                                                   hf_state):
    import torch

    from rlcore.runtime import LocalTrainer
    from rlcore.training.weights import chunked
    from rlcore.utils import torch_dtype
    from rlcore_sglang.transport import SglangTensorTransport

    class StateDict:  # a backend's export_weights over a state dict (what a trainer handle streams)
        def __init__(self, state):
            self.state, self.dtypes = state, set()

        def export_weights(self, dtype=None, chunk_bytes=1 << 30):  # dtype: a torch dtype or its name, as backends take it
            self.dtypes.add(dtype)
            yield from chunked(((n, t.to(torch_dtype(dtype)) if dtype else t) for n, t in self.state.items()), chunk_bytes)

    g = torch.Generator().manual_seed(3)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in hf_state.items()}
    backend = StateDict(new)
    trainer = LocalTrainer(backend)
    transport = sglang_plugin_manager.weight_transport(trainer=trainer, generator=sglang_generator)
    assert isinstance(transport, SglangTensorTransport)
    version = sglang_generator.weights_version
    try:
        moved = transport.transfer(trainer, sglang_generator)
        assert backend.dtypes == {"bfloat16"} and moved["bytes"] == sum(t.numel() * 2 for t in new.values())
        assert sglang_generator.weights_version == version + 1
        probe = [[1, 5, 9, 13, 2, 4, 6, 8], [3, 3, 2, 2, 1]]
        reference = _hf_logprobs(tiny_model_dir, {n: t.to(torch.bfloat16).float() for n, t in new.items()}, probe)
        gaps = [abs(a - b) for s, r in zip(sglang_generator.score(probe), reference) for a, b in zip(s, r)]
        assert max(gaps) < BF16_ATOL, f"score after the refit vs the new weights: max gap {max(gaps)}"
    finally:
        sglang_generator.update_weights(iter([list(hf_state.items())]))


def test_sleep_gives_the_memory_back_and_a_wake_up_with_a_refit_generates_as_before(sglang_generator, hf_state):
    import torch

    prompts = [[1, 5, 9, 13], [2, 4, 6]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = [r[0].response_ids for r in sglang_generator.generate(prompts, greedy)]
    free_awake, total = torch.cuda.mem_get_info()
    sglang_generator.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    # mem_fraction_static 0.3 holds the weights and the KV cache; both are released
    assert free_asleep - free_awake > 0.5 * 0.3 * total, f"sleep freed {(free_asleep - free_awake) / 2**30:.2f} GiB"
    with pytest.raises(RuntimeError, match="asleep"):
        sglang_generator.generate(prompts, greedy)
    sglang_generator.wake_up()
    sglang_generator.update_weights(iter([list(hf_state.items())]))  # the GRPO loop's refit after each wake-up
    assert [r[0].response_ids for r in sglang_generator.generate(prompts, greedy)] == before


def test_a_wake_up_without_room_is_refused_naming_what_makes_room(sglang_generator, hf_state):
    """A trainer that took the GPU while the engine slept (here: one tensor leaving 1 GiB free): the
    wake-up is refused before SGLang maps anything, and succeeds once the memory is back."""
    import torch

    sglang_generator.sleep()
    hog = torch.empty(torch.cuda.mem_get_info()[0] - (1 << 30), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(MemoryError, match=r"SGLang cannot wake up.*offload_trainer_state.*gpu_memory_utilization"):
            sglang_generator.wake_up()
        assert sglang_generator.sleeping
    finally:
        del hog
        torch.cuda.empty_cache()
    sglang_generator.wake_up()
    sglang_generator.update_weights(iter([list(hf_state.items())]))
    assert len(sglang_generator.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0]) == 1


def test_agenerate_from_several_event_loops_and_threads(sglang_generator):
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    results = [asyncio.run(sglang_generator.agenerate([1, 2, 3], params)) for _ in range(2)]
    thread_result = []
    worker = threading.Thread(target=lambda: thread_result.append(asyncio.run(sglang_generator.agenerate([4, 5], params))))
    worker.start()
    worker.join(timeout=120)
    results += thread_result
    assert len(results) == 3 and all(1 <= len(r.response_ids) <= 4 for r in results)
