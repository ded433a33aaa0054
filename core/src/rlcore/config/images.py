"""Schemas of the image-prompt datasets (``data.name: images`` and ``image_counting``, see
:mod:`rlcore.data.image_data`). Imports no torch and no PIL."""

from __future__ import annotations

import attrs
from attrs import field, frozen

from rlcore.config.structure import doc

MAX_IMAGE_PIXELS = 4096 * 4096  # larger images are refused before decoding (a decompression bomb guard)


@frozen(kw_only=True)
class ImageDataConfig:
    """An image-prompt JSONL dataset (``data.name: images``); the image processor is the one saved
    beside the tokenizer (``policy.tokenizer_name`` or ``policy.model_name``)."""

    name: str = field(default="images", metadata=doc("the dataset plugin"))
    train_path: str = field(metadata=doc("the training rows (JSONL; image paths are relative to this file)"))
    validation_path: str | None = field(default=None, metadata=doc("held-out rows (JSONL); None = no validation"))
    skip_bad_images: bool = field(default=False, metadata=doc(
        "a row whose image is missing, unreadable, truncated or too large is skipped and counted; false: an error "
        "naming the file and row"))
    max_image_pixels: int = field(default=MAX_IMAGE_PIXELS, validator=attrs.validators.gt(0),
                                  metadata=doc("larger images are bad images (checked before decoding)"))


@frozen(kw_only=True)
class CountingTaskConfig:
    """The synthetic counting task (``data.name: image_counting``): images of coloured squares, written
    to ``directory`` (seeded) and loaded as an image dataset."""

    name: str = field(default="image_counting", metadata=doc("the dataset plugin"))
    directory: str = field(default="runs/image_counting/data", metadata=doc("where the images and JSONL files are written"))
    num_train: int = field(default=256, validator=attrs.validators.gt(0), metadata=doc("training prompts"))
    num_validation: int = field(default=64, validator=attrs.validators.ge(0), metadata=doc("held-out prompts"))
    max_count: int = field(default=3, validator=attrs.validators.in_(range(1, 10)), metadata=doc("at most this many squares (1-9)"))
    seed: int = field(default=0, metadata=doc("the training images' seed (validation uses seed + 1)"))
    image_side: int = field(default=56, validator=attrs.validators.ge(28), metadata=doc(
        "each image's width and height in pixels (the model's processor decides how many image tokens that is)"))
