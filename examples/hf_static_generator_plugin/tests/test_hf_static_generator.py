"""rlcore's generator conformance suite against ``hf_static`` (built through its entry point),
and its refit transport chosen through the ``rlcore_weight_transport`` hook."""

from __future__ import annotations

import pytest

from rlcore.testing.conformance import GeneratorConformance


def _build(model_dir, **keys):
    import rlcore
    from rlcore.interfaces import Placement
    from rlcore.plugins import get_plugin_manager

    config = rlcore.build_config({"policy": {"model_name": str(model_dir), "max_total_sequence_length": 64,
                                             "generation": {"backend": "hf_static", **keys}}})
    reg = get_plugin_manager().get("generator", "hf_static")
    return reg.build(config, config.generation, Placement())


# tiny_model_dir: a fixture of rlcore.testing's pytest plugin (a saved random-init Llama).
class TestStaticCacheConformance(GeneratorConformance):
    logprob_atol = 1e-4  # fp32: generate()'s scores and a plain forward agree closely

    @pytest.fixture(scope="class")
    def generator_model_dir(self, tiny_model_dir):
        return tiny_model_dir

    @pytest.fixture(scope="class")
    def generator(self, generator_model_dir):
        generator = _build(generator_model_dir)
        yield generator
        generator.shutdown()


def test_batched_greedy_equals_one_prompt_at_a_time(tiny_model_dir):
    """Left padding and the static cache change no row: a batch decodes as its prompts do alone."""
    from rlcore.interfaces import SamplingParams

    generator = _build(tiny_model_dir, batch_rows=8)
    prompts = [[5, 9, 11], [7, 3, 21, 40, 8, 2, 19], [30]]
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    together = generator.generate(prompts, params)
    alone = [generator.generate([p], params)[0] for p in prompts]
    assert [r[0].response_ids for r in together] == [r[0].response_ids for r in alone]


def test_stop_token_and_seeded_sampling(tiny_model_dir):
    from rlcore.interfaces import SamplingParams

    generator = _build(tiny_model_dir)
    prompt = [5, 9, 11]
    greedy = generator.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))[0][0]
    stop = greedy.response_ids[2]
    first = greedy.response_ids.index(stop)
    stopped = generator.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True,
                                                          stop_token_ids=(stop,)))[0][0]
    assert stopped.response_ids == greedy.response_ids[: first + 1] and stopped.finish_reason == "stop"
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6, n=4, seed=3, ignore_eos=True)
    a, b = generator.generate([prompt], sampled), generator.generate([prompt], sampled)
    assert [r.response_ids for r in a[0]] == [r.response_ids for r in b[0]]
    assert len({tuple(r.response_ids) for r in a[0]}) > 1  # n rows are n draws, not one repeated


def test_weight_transport_hook_picks_this_plugins_transport(tiny_model_dir):
    """rlcore asks every plugin's ``rlcore_weight_transport``: this one claims its own generator
    (the trainer's chunks in the generator's dtype) and leaves any other kind to other plugins.
    The transfer itself runs in rlcore's repository test of both examples (a real run's refits)."""
    import rlcore
    from rlcore.interfaces import Placement
    from rlcore.plugins import get_plugin_manager

    manager = get_plugin_manager()
    ours = _build(tiny_model_dir, dtype="bfloat16")
    transport = manager.weight_transport(trainer=None, generator=ours)
    assert transport.name == "hf_static-in-place" and transport.dtype == "bfloat16"
    config = rlcore.build_config({"policy": {"model_name": str(tiny_model_dir), "generation": {"backend": "hf"}}})
    builtin = manager.get("generator", "hf").build(config, config.generation, Placement())
    found = manager.weight_transport(trainer=None, generator=builtin)
    assert found is None or found.name != transport.name
