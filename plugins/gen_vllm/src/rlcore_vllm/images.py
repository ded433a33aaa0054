"""Prompts with images for vLLM: which vision-language families the vllm generator runs, and how
rlcore's prompt (placeholders already expanded, pixels already processed) becomes a vLLM request.

vLLM runs these families through its transformers backend (``model_impl="transformers"``): its
LLaVA model code imports transformers' torchvision image processors (through Pixtral's), while the
transformers backend uses the model's own transformers classes and processor, which load without
torchvision. That backend builds each request's prompt itself: it decodes the prompt ids, runs
the model's processor on the text and the images, and takes the processor's ids. So a request
carries each image's placeholder once (the expanded run collapsed), and the pixels rlcore
processed, with the processor's resizing, cropping, rescaling and normalizing turned off (they
were done once, by the same processor, when the prompt was built): the engine sees exactly the
trainer's pixels. The ids the engine ends up with are checked against rlcore's: a sequence whose
ids do not come back from decoding and encoding its text (a tokenization the tokenizer would not
produce, which a model can sample) is an error naming it, rather than a score of other tokens.

Qwen2.5-VL and Qwen3-VL are not among them: vLLM's Qwen2-VL family code and the Qwen processors'
video processor require torchvision (:func:`rlcore_vllm.generator.check_vision_language`).
"""

from __future__ import annotations

from typing import Any

from rlcore.data.multimodal import ImageInputs

# model_type -> vLLM's model_impl for it
VLLM_IMAGE_FAMILIES = {"llava": "transformers"}
# The image processor's own steps, already applied to the pixels a request carries.
ALREADY_PROCESSED = {"do_resize": False, "do_center_crop": False, "do_rescale": False, "do_normalize": False,
                     "do_convert_rgb": False}
# vLLM clamps logit biases to [-100, 100]: -100 on a token's logit makes drawing it impossible in
# practice (exp(-100) ~ 4e-44 of the mass), and the logprobs vLLM reports are raw.
NEVER_SAMPLE_BIAS = -100.0


def never_sampled(image_token: int, tokenizer_size: int, vocab_size: int) -> dict[int, float]:
    """The logit bias that keeps a response of an image prompt scorable: the placeholder (a response
    holding one would not match its images) and the ids past the tokenizer's vocabulary (the
    model's padded rows: they have no text, so they would not survive the engine's decode and
    encode of the sequence)."""
    return {token: NEVER_SAMPLE_BIAS for token in [image_token, *range(tokenizer_size, vocab_size)]}


def image_family(hf_config: Any) -> str | None:
    """The model_impl vLLM runs this vision-language family with, or None if the vllm generator does not take its images."""
    return VLLM_IMAGE_FAMILIES.get(getattr(hf_config, "model_type", None))


def collapse_placeholders(ids: list[int], image_token: int, images: ImageInputs, where: str) -> list[int]:
    """``ids`` with each image's expanded run of ``image_token`` back to one token (what the
    model's processor expands). Every image of these fixed-resolution families has the same
    number of tokens; adjacent images form one run, split by that count."""
    total = sum(1 for token in ids if token == image_token)
    count = images.num_images
    if count == 0 or total % count:
        raise ValueError(f"{where}: {total} image tokens do not split evenly over its {count} images")
    per_image = total // count
    out: list[int] = []
    run = 0
    for token in [*ids, None]:
        if token == image_token:
            run += 1
            continue
        if run:
            if run % per_image:
                raise ValueError(f"{where}: a run of {run} image tokens is not a whole number of images "
                                 f"({per_image} tokens each)")
            out += [image_token] * (run // per_image)
            run = 0
        if token is not None:
            out.append(token)
    return out


def image_request(ids: list[int], images: ImageInputs | None, image_token: int, where: str) -> dict[str, Any]:
    """The vLLM prompt (a ``TokensPrompt`` mapping) of ``ids`` with ``images``."""
    if images is None or images.num_images == 0:
        return {"prompt_token_ids": list(ids)}
    if images.image_grid_thw_I3 is not None:
        raise ValueError(f"{where}: patch-grid images (Qwen-VL) are not taken by the vllm generator")
    pixels = [images.pixel_values[i].float().cpu().numpy() for i in range(images.num_images)]
    return {"prompt_token_ids": collapse_placeholders(ids, image_token, images, where),
            "multi_modal_data": {"image": pixels}, "mm_processor_kwargs": dict(ALREADY_PROCESSED)}


def check_engine_ids(sent: list[int], engine_ids: list[int] | None, where: str) -> None:
    """The engine's prompt ids (after its processor expanded the placeholders) are rlcore's."""
    engine_ids = list(engine_ids or [])
    if engine_ids == list(sent):
        return
    at = next((i for i, (a, b) in enumerate(zip(sent, engine_ids)) if a != b), min(len(sent), len(engine_ids)))
    raise RuntimeError(f"{where}: vLLM's processor turned the sequence into other ids than rlcore's ({len(engine_ids)} "
                       f"tokens, rlcore's {len(sent)}; from position {at}: {engine_ids[at:at + 6]} for {list(sent[at:at + 6])}): "
                       "its ids do not come back from decoding and encoding its text, or the model directory's processor "
                       "is not the one the prompts were built with")
