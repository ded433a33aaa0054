"""A Qwen2.5-VL-3B-shaped model directory for `rlcore bench step` (config, tokenizer, processor; no weights).

Qwen2.5-VL-3B-Instruct's published shape: a 36-layer decoder (hidden 2048, 16 query / 2 key-value
heads of head_dim 128, FFN 11008, vocabulary 151936, tied embeddings, multimodal rope sections
16/24/24) and a 32-block vision tower (hidden 1280, 16 heads, FFN 3420, 14-pixel patches merged 2x2,
112-pixel attention windows, full attention in blocks 7, 15, 23 and 31) projected to 2048. Its
tokenizer here is rlcore's tiny one with Qwen-VL's vision tokens (the vocabulary rows past it are
padding: the embedding and head keep the real size), its image processor Qwen2-VL's with at most
``max_patches`` patches a side. ``rlcore bench step`` builds random bf16 weights of this config on
the GPU; nothing is downloaded.

    python benchmarks/vlm_shapes.py /tmp/qwen25vl3b
    rlcore bench step recipes/grpo_image_counting_tiny_cpu.yaml policy.model_name=/tmp/qwen25vl3b ...

``--tiny`` writes the same structure at CPU size (a check of the command line).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def qwen2_5_vl_3b_config(tokenizer, *, tiny: bool = False):
    """transformers ``Qwen2_5_VLConfig`` of the 3B shape (``tiny``: 2 + 2 layers of width 128)."""
    from transformers import Qwen2_5_VLConfig

    from rlcore.testing.tiny_vlm import VISION_TOKENS, tiny_vlm_config

    if tiny:
        return tiny_vlm_config(tokenizer, "qwen2_5_vl")
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                            tie_word_embeddings=True, dtype="bfloat16")


def write_model_directory(out: Path, *, max_patches: int = 32, tiny: bool = False) -> Path:
    from rlcore.testing.tiny_vlm import build_image_processor, build_vlm_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer()
    qwen2_5_vl_3b_config(tokenizer, tiny=tiny).save_pretrained(out)
    tokenizer.save_pretrained(out)
    build_image_processor("qwen2_5_vl", max_patches=max_patches).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-patches", type=int, default=32, help="patches a side at most (32: 448-pixel images, 256 image tokens)")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    print(write_model_directory(args.out, max_patches=args.max_patches, tiny=args.tiny))


if __name__ == "__main__":
    main()
