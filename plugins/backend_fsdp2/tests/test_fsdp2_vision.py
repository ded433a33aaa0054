"""Vision-language prompts end to end on a tiny random-init Qwen2.5-VL, Qwen3-VL and LLaVA (built from a config, saved
with save_pretrained, loaded back by the hf generator and the fsdp2 backend): image rows of a
JSONL file, the generator's sampling and scoring with images, the trainer's logprobs of the same
sequences, packed against unpacked micro-batches, training with the vision tower trained or
frozen, and the GRPO loop through ``rlcore.run``."""

from __future__ import annotations

import attrs
import pytest
import torch

from rlcore.interfaces import SamplingParams, SequenceBatch

pytest.importorskip("PIL")


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "llava"])
def vlm(request, tmp_path_factory):
    from transformers import AutoTokenizer

    from rlcore.data.image_data import build_image_dataset, write_counting_task
    from rlcore.data.multimodal import load_prompt_processor
    from rlcore.testing.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm")
    model_dir = build_tiny_vlm(root / "model", request.param)
    processor = load_prompt_processor(model_dir, AutoTokenizer.from_pretrained(model_dir))
    dataset = build_image_dataset(write_counting_task(root / "data", 6, seed=3), processor)
    return model_dir, dataset, root


@pytest.fixture(scope="module")
def generator(vlm):
    from rlcore.config.hf_generation import HFGenerationConfig
    from rlcore.generation.hf_generator import HFGenerator

    return HFGenerator(str(vlm[0]), HFGenerationConfig(), 256)


@pytest.fixture(scope="module")
def rollouts(vlm, generator):
    """Two samples of each of three image prompts, and each sequence's prompt images."""
    samples = vlm[1].train[:3]
    results = generator.generate_with_images([s.prompt_ids for s in samples], [s.images for s in samples],
                                             SamplingParams(max_new_tokens=5, n=2, seed=7))
    flat = [r for group in results for r in group]
    images = [s.images for s in samples for _ in range(2)]
    return flat, images


def _batch(flat, images) -> SequenceBatch:
    return SequenceBatch(
        input_ids=[torch.tensor(r.prompt_ids + r.response_ids) for r in flat],
        loss_mask=[torch.tensor([0.0] * len(r.prompt_ids) + [1.0] * len(r.response_ids)) for r in flat],
        seq_fields={"advantages": torch.linspace(-1, 1, len(flat))}, images=images)


def _backend(model_dir, *, precision="float32", mb_tokens=4096, **dtensor):
    from rlcore.config.schema import OptimizerConfig, PolicyConfig, RunConfig, SequencePackingConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig

    cfg = DTensorConfig(**dtensor)
    policy = PolicyConfig(model_name=str(model_dir), precision=precision, optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
                          sequence_packing=SequencePackingConfig(train_mb_tokens=mb_tokens, logprob_mb_tokens=mb_tokens))
    return FSDP2Backend(RunConfig(policy=policy, sections={SECTION: cfg}), cfg, WorldInfo())


def test_prompt_placeholders_match_the_image_grid(vlm):
    from rlcore.testing.tiny_vlm import build_llava_tokenizer, build_vlm_tokenizer

    sample = vlm[1].train[0]
    if sample.images.image_grid_thw_I3 is None:  # LLaVA: one 56x56 crop, 4x4 patches of 14 pixels and CLIP's class token
        assert tuple(sample.images.pixel_values.shape) == (1, 3, 56, 56)
        assert sample.prompt_ids.count(build_llava_tokenizer().convert_tokens_to_ids("<image>")) == 17
        return
    image_token = build_vlm_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    grid = sample.images.image_grid_thw_I3
    assert grid.tolist() == [[1, 4, 4]]  # a 56x56 image: 4x4 patches of 14 pixels
    assert sample.prompt_ids.count(image_token) == int(grid.prod()) // 4  # merged 2x2
    assert sample.images.pixel_values.shape[0] == int(grid.prod())


def test_generation_sees_the_image_and_scores_what_it_sampled(vlm, generator, rollouts):
    flat, images = rollouts
    scored = generator.score_with_images([r.prompt_ids + r.response_ids for r in flat], images)
    for result, values in zip(flat, scored):
        # sampling renormalizes over the tokens a model may write (the vision placeholders left out),
        # so a sampled token's logprob is at least its full-vocabulary one
        full = torch.tensor(values[len(result.prompt_ids):])
        assert (torch.tensor(result.response_logprobs) >= full - 1e-5).all()
    image_token = generator.image_token
    assert all(image_token not in r.response_ids for r in flat)
    sample = vlm[1].train[0]
    other = attrs.evolve(sample.images, pixel_values=sample.images.pixel_values.flip(-1))
    a, b = generator.score_with_images([sample.prompt_ids + [10, 11]] * 2, [sample.images, other])
    assert abs(a[-1] - b[-1]) > 1e-4  # the pixels reach the logits


def test_generation_encodes_shared_images_once(vlm, generator):
    """Two rows with one images object: the prefill encodes it once and samples what two copies give."""
    from rlcore.data.multimodal import vision_modules

    sample = vlm[1].train[0]
    copy = attrs.evolve(sample.images, pixel_values=sample.images.pixel_values.clone())
    params = SamplingParams(max_new_tokens=4, seed=5)
    encoded = []
    handle = vision_modules(generator.model)[0].register_forward_hook(lambda m, args, out: encoded.append(args[0].shape[0]))
    try:
        shared = generator.generate_with_images([sample.prompt_ids] * 2, [sample.images] * 2, params)
        copies = generator.generate_with_images([sample.prompt_ids] * 2, [sample.images, copy], params)
    finally:
        handle.remove()
    rows = sample.images.pixel_values.shape[0]
    assert encoded == [rows, 2 * rows]
    for (a,), (b,) in zip(shared, copies):
        assert a.response_ids == b.response_ids
        # fp32: each row's arithmetic is the same; the vision GEMMs' row count differs (2x), which may
        # change their blocking: agreement to float32 rounding through a few layers
        assert torch.allclose(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5)


def test_trainer_logprobs_match_the_generator_and_packing(single_process_group, vlm, generator, rollouts):
    flat, images = rollouts
    batch = _batch(flat, images)
    scored = generator.score_with_images([ids.tolist() for ids in batch.input_ids], images)
    backend = _backend(vlm[0])
    try:
        assert backend.model.config.text_config._attn_implementation == "rlcore_varlen"
        trained = backend.logprobs(batch)
        for lp, ref, mask in zip(trained, scored, batch.loss_mask):
            on = mask > 0
            # fp32, the same per-sequence attention: agreement to float32 rounding of ~10 logits ops
            assert torch.allclose(lp[on], torch.tensor(ref)[on], atol=1e-5), (lp[on], torch.tensor(ref)[on])
    finally:
        backend.shutdown()


def test_packed_and_unpacked_losses_agree_in_float64(single_process_group, vlm, rollouts):
    from rlcore.data.packing import make_micro_batches, step_totals

    batch = _batch(*rollouts)
    backend = _backend(vlm[0], precision="float64")
    try:
        def total(max_tokens: int) -> float:
            out = torch.zeros((), dtype=torch.float64)
            with torch.no_grad():
                for mb in make_micro_batches(batch, max_tokens):
                    lp_T = backend._forward_logprobs(mb)
                    out += (lp_T * mb.loss_mask_T.double() * mb.seq_fields["advantages"].double()[mb.seq_index_T.clamp(min=0)]).sum()
            return float(out) / step_totals(batch).num_valid_tokens

        longest = max(batch.lengths())
        one_per_mb = total(longest)  # every sequence alone
        packed = total(sum(batch.lengths()))  # all six in one row
        assert len(make_micro_batches(batch, longest)) > 1 and len(make_micro_batches(batch, sum(batch.lengths()))) == 1
        assert abs(one_per_mb - packed) < 1e-12
    finally:
        backend.shutdown()


def test_shared_images_are_encoded_once_with_the_same_logprobs_and_gradients(single_process_group, vlm, rollouts):
    """A group's samples share their prompt's images (one object): the vision tower runs on each distinct
    image once, and the logprobs and the tower's gradients equal those of encoding every copy."""
    from rlcore.data.multimodal import vision_modules
    from rlcore.data.packing import make_micro_batches

    flat, images = rollouts  # two samples of each prompt: each images object appears twice
    copies = [attrs.evolve(i, pixel_values=i.pixel_values.clone()) for i in images]  # same pixels, six objects
    backend = _backend(vlm[0], precision="float64")
    tower = vision_modules(backend.model)[0]
    encoded = []
    handle = tower.register_forward_hook(lambda module, args, output: encoded.append(args[0].shape[0]))
    try:
        def run(per_seq):
            batch = _batch(flat, per_seq)
            (mb,) = make_micro_batches(batch, sum(batch.lengths()))  # all six sequences in one forward
            backend.model.zero_grad(set_to_none=True)
            logprobs_T = backend._forward_logprobs(mb)
            (logprobs_T * mb.loss_mask_T.double()).sum().backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in tower.named_parameters() if p.grad is not None}
            return logprobs_T.detach(), grads

        shared_lp, shared_grads = run(images)
        copied_lp, copied_grads = run(copies)
        rows = [sum(i.pixel_values.shape[0] for i in per_seq) for per_seq in (images[::2], images)]
        assert encoded == rows  # three distinct images, then all six
        # float64, each image's rows computed alike: the forward agrees to float64 rounding
        assert torch.allclose(shared_lp, copied_lp, rtol=0, atol=1e-12)
        # The backward sums the copies' gradients before the tower instead of after it. transformers runs
        # the vision rotary embedding in float32 (it casts q and k), so gradients that differ in float64's
        # last bits can round to neighbouring float32 values there: agreement to a few float32 ulps of the
        # tower's largest gradient (some gradients, such as a key bias's, are zero up to rounding).
        assert shared_grads and shared_grads.keys() == copied_grads.keys()
        scale = max(float(grad.abs().max()) for grad in copied_grads.values())
        for name, grad in shared_grads.items():
            assert float((grad - copied_grads[name]).abs().max()) <= 8 * 2.0**-23 * scale, name
    finally:
        handle.remove()
        backend.shutdown()


@pytest.mark.parametrize("freeze", [False, True])
def test_training_moves_the_vision_tower_unless_frozen(single_process_group, vlm, rollouts, freeze):
    from rlcore.plugins import get_plugin_manager
    from rlcore.config.structure import structure

    batch = _batch(*rollouts)
    batch.token_fields["advantages"] = [torch.full(ids.shape, float(a)) for ids, a in zip(batch.input_ids, batch.seq_fields["advantages"])]
    reg = get_plugin_manager().get("algorithm", "grpo")
    algorithm = reg.build(structure(reg.config_cls, {"kl_coef": 0.0}))
    algorithm.uses_old_logprobs = False
    backend = _backend(vlm[0], freeze_vision_tower=freeze)
    try:
        def weights(prefix):
            return {n: p.full_tensor().clone() for n, p in backend.model.named_parameters() if n.startswith(prefix)}

        tower = "model.visual." if hasattr(backend.model.model, "visual") else "model.vision_tower."
        vision, text = weights(tower), weights("model.language_model.")
        assert vision
        metrics = backend.train(batch, algorithm)
        assert torch.isfinite(torch.tensor(metrics["loss"]))
        moved = {n for n, p in weights(tower).items() if not torch.equal(p, vision[n])}
        assert (not moved) if freeze else moved
        assert any(not torch.equal(p, text[n]) for n, p in weights("model.language_model.").items())
    finally:
        backend.shutdown()


def test_grpo_recipe_runs_with_image_prompts(vlm):
    """The CPU recipe, two steps: rollouts with images, refit of language and vision weights into the
    hf generator, the refit probe on image prompts (the recipe's model family only)."""
    import json
    from pathlib import Path

    import yaml

    import rlcore

    model_dir, _, root = vlm
    if "Qwen2_5" not in (model_dir / "config.json").read_text():
        pytest.skip("the recipe runs Qwen2.5-VL; Qwen3-VL is covered by the tests above")
    recipe = yaml.safe_load((Path(__file__).parents[3] / "recipes/grpo_image_counting_tiny_cpu.yaml").read_text())
    config = rlcore.build_config(recipe, [f"policy.model_name={model_dir}", f"data.directory={root / 'recipe_data'}",
                                          f"logger.log_dir={root / 'log'}", "train.max_num_steps=2", "train.val_period=2",
                                          "data.num_train=16", "data.num_validation=4", "train.max_val_samples=4",
                                          "train.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2"])
    rlcore.run(config)
    rows = [json.loads(line) for line in (root / "log" / "metrics.jsonl").read_text().splitlines()]
    probes = [r["refit/probe_max_abs_logprob_diff"] for r in rows if "refit/probe_max_abs_logprob_diff" in r]
    assert probes and max(probes) < 1e-4  # the generator holds the trainer's weights after each refit
