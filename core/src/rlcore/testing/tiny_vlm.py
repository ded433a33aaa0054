"""A tiny Qwen2.5-VL, Qwen3-VL or LLaVA built from a config with random weights, and its tokenizer and
image processor, saved with ``save_pretrained`` for tests and the CPU recipe.

Qwen: the tokenizer is :mod:`rlcore.testing.tiny`'s character-level one plus Qwen-VL's vision tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``), with a chat template that renders a
``{"type": "image"}`` entry the way Qwen2.5-VL's does. The image processor is transformers'
Qwen2-VL one (PIL backend) with the family's patches (14 pixels for Qwen2.5-VL, 16 for Qwen3-VL)
merged 2x2: a 56x56 image is 4x4 patches, 4 image tokens. Text head_dim is 64 (as the text tiny
models'); ``mrope_section`` splits its 32 rotary frequencies over temporal, height and width.

LLaVA (``arch="llava"``): a CLIP vision tower and a Llama decoder; the image entry renders as
``<image>``, which the saved ``LlavaProcessor`` (CLIP image processor, PIL backend) repeats once per
vision feature: a 56x56 image (resized and cropped to 56x56) is 4x4 patches of 14 pixels plus the
CLIP class token, 17 image tokens. Its processor loads without torchvision, and vLLM runs it
through its transformers backend (see :mod:`rlcore_vllm`'s generator).
"""

from __future__ import annotations

from pathlib import Path

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% elif m['role'] == 'system' %}{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_vlm_tokenizer():
    from rlcore.testing.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|tool|>", *VISION_TOKENS]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


LLAVA_IMAGE_TOKEN = "<image>"
LLAVA_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", LLAVA_IMAGE_TOKEN)
LLAVA_IMAGE_SIZE = 56


def build_llava_tokenizer():
    from rlcore.testing.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|tool|>", LLAVA_IMAGE_TOKEN]})
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    return tok


ARCHITECTURES = ("qwen2_5_vl", "qwen3_vl", "llava")
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}  # pixels per patch side


def build_image_processor(arch: str = "qwen2_5_vl", max_patches: int = 8):
    """Qwen2-VL's image processor (PIL backend), at most ``max_patches`` patches a side."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = PATCH[arch]
    return Qwen2VLImageProcessorPil(min_pixels=(4 * side) ** 2, max_pixels=(max_patches * side) ** 2, patch_size=side,
                                    merge_size=2, temporal_patch_size=2)


def tiny_vlm_config(tokenizer, arch: str = "qwen2_5_vl", *, hidden_size: int = 128, num_layers: int = 2, vision_depth: int = 2):
    """Qwen2.5-VL (windowed vision attention), Qwen3-VL (deepstack features into the first decoder layers)
    or LLaVA (a CLIP tower's every patch feature and its class token, projected into a Llama decoder)."""
    from transformers import LlavaConfig, Qwen2_5_VLConfig, Qwen3VLConfig

    from rlcore.testing.tiny import _round_up

    if arch == "llava":
        text = dict(model_type="llama", vocab_size=_round_up(len(tokenizer), 64), hidden_size=hidden_size,
                    intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64,
                    num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        vision = dict(model_type="clip_vision_model", hidden_size=128, intermediate_size=256, num_hidden_layers=vision_depth,
                      num_attention_heads=2, image_size=LLAVA_IMAGE_SIZE, patch_size=14, projection_dim=hidden_size)
        return LlavaConfig(text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
                           vision_feature_layer=-1, vision_feature_select_strategy="full", tie_word_embeddings=False)

    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    text = dict(vocab_size=_round_up(len(tokenizer), 64), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64, num_key_value_heads=1,
                max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=vision_depth, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=hidden_size,
                  patch_size=PATCH[arch], spatial_merge_size=2, temporal_patch_size=2)
    tokens = dict(image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    if arch == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
        vision.update(window_size=56, fullatt_block_indexes=[vision_depth - 1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    if arch == "qwen3_vl":
        text.update(head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                                                  "mrope_interleaved": True})
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
        return Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
    raise ValueError(f"unknown tiny vision-language architecture {arch!r}; choose one of {ARCHITECTURES}")


def build_tiny_vlm(path: str | Path, arch: str = "qwen2_5_vl", *, seed: int = 0, init_std: float | None = 0.05,
                   **config_kwargs) -> Path:
    """Random-init a tiny vision-language model of ``arch``, save it with its tokenizer and image processor to ``path``."""
    import torch
    from transformers import AutoModelForImageTextToText

    path = Path(path)
    tokenizer = build_llava_tokenizer() if arch == "llava" else build_vlm_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config(tokenizer, arch, **config_kwargs), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and init_std is not None:
                param.normal_(0.0, init_std)
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if arch == "llava":
        build_llava_processor(tokenizer).save_pretrained(path)
    else:
        build_image_processor(arch).save_pretrained(path)
    return path


def build_llava_processor(tokenizer):
    """LLaVA's processor over CLIP's image processor (PIL backend): 56x56 crops, 17 image tokens each."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    side = LLAVA_IMAGE_SIZE
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14, image_token=LLAVA_IMAGE_TOKEN,
                          vision_feature_select_strategy="full", num_additional_image_tokens=1,
                          chat_template=tokenizer.chat_template)
