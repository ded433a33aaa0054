"""Prompt datasets with images (JSONL), and a synthetic visual task made with PIL.

A row of an image dataset::

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many squares?"}]}],
     "images": ["images/0.png"], "answer": "3"}

``images`` are paths relative to the data file or ``data:image/png;base64,...`` strings, one per
``{"type": "image"}`` entry, in order. Each row becomes a :class:`rlcore.interfaces.Sample` whose
``prompt_ids`` hold the expanded image placeholders and whose ``images`` hold the processed
pixels (:class:`rlcore.data.multimodal.ImagePromptProcessor`). A bad image (missing, not an image,
truncated, too large) is an :class:`rlcore.data.multimodal.ImageError` naming the file and row, or,
with ``skip_bad_images``, a skipped row, counted in :attr:`ImageDataset.skipped`.

The counting task (:func:`write_counting_task`): white images with 1 to ``max_count`` coloured
squares placed without overlap; the question asks how many; the answer is the digit. Seeded, so
the same call writes the same files. :class:`CountingEnv` gives reward 1 when the response's
first digit is the count.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from rlcore.config.images import CountingTaskConfig, ImageDataConfig
from rlcore.interfaces import EnvStep, Sample
from rlcore.data.multimodal import MAX_IMAGE_PIXELS, ImageError, ImagePromptProcessor, load_image

QUESTION = "How many squares?"
COLOURS = ("red", "blue", "green", "black")


@attrs.define
class ImageDataset:
    """A :class:`rlcore.interfaces.PromptDataset` of image prompts."""

    train: list[Sample]
    validation: list[Sample] | None = None
    skipped: int = 0  # rows dropped for bad images (``skip_bad_images``)


def _processor(tokenizer: Any) -> ImagePromptProcessor:
    from rlcore.data.multimodal import load_prompt_processor

    return load_prompt_processor(tokenizer.name_or_path, tokenizer)


def build_from_config(config: ImageDataConfig, tokenizer: Any) -> ImageDataset:
    """Factory of the ``images`` dataset."""
    return build_image_dataset(config.train_path, _processor(tokenizer), config.validation_path,
                               skip_bad_images=config.skip_bad_images, max_image_pixels=config.max_image_pixels)


def build_counting(config: CountingTaskConfig, tokenizer: Any) -> ImageDataset:
    """Factory of the ``image_counting`` dataset."""
    train = write_counting_task(config.directory, config.num_train, seed=config.seed, max_count=config.max_count,
                                side=config.image_side)
    validation = None
    if config.num_validation:
        validation = write_counting_task(config.directory, config.num_validation, seed=config.seed + 1,
                                         max_count=config.max_count, name="validation", side=config.image_side)
    return build_image_dataset(train, _processor(tokenizer), validation)


def load_image_jsonl(path: str | Path, processor: ImagePromptProcessor, *, skip_bad_images: bool = False,
                     max_image_pixels: int = MAX_IMAGE_PIXELS) -> tuple[list[Sample], int]:
    """The samples of one JSONL file and how many rows were skipped for bad images."""
    path = Path(path)
    samples: list[Sample] = []
    skipped = 0
    for row_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        source = f"{path}:{row_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not a JSON object ({exc})") from None
        refs = row.get("images") or []
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise ValueError(f"{source}: 'images' must be a list of paths or data: URLs")
        try:
            images = [load_image(ref, path.parent, source, max_image_pixels) for ref in refs]
        except ImageError:
            if not skip_bad_images:
                raise
            skipped += 1
            continue
        messages = row.get("messages")
        if not isinstance(messages, list):
            raise ValueError(f"{source}: 'messages' must be a list of chat messages")
        try:
            prompt_ids, pixels = processor(messages, images)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        samples.append(Sample(prompt=messages, answer=row.get("answer"), prompt_ids=prompt_ids, images=pixels,
                              index=len(samples), response=row.get("response")))
    return samples, skipped


def build_image_dataset(train_path: str | Path, processor: ImagePromptProcessor, validation_path: str | Path | None = None,
                        *, skip_bad_images: bool = False, max_image_pixels: int = MAX_IMAGE_PIXELS) -> ImageDataset:
    train, skipped = load_image_jsonl(train_path, processor, skip_bad_images=skip_bad_images, max_image_pixels=max_image_pixels)
    validation = None
    if validation_path is not None:
        validation, more = load_image_jsonl(validation_path, processor, skip_bad_images=skip_bad_images,
                                            max_image_pixels=max_image_pixels)
        skipped += more
    return ImageDataset(train, validation, skipped)


# ---- the counting task -----------------------------------------------------------------------
def draw_squares(count: int, rng: random.Random, side: int = 56, square: int = 12):
    """A white ``side`` x ``side`` image with ``count`` non-overlapping coloured squares."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(image)
    cells = [(x, y) for x in range(0, side - square, square + 2) for y in range(0, side - square, square + 2)]
    for x, y in rng.sample(cells, count):
        draw.rectangle([x, y, x + square - 1, y + square - 1], fill=rng.choice(COLOURS))
    return image


def write_counting_task(directory: str | Path, num_rows: int, *, seed: int = 0, max_count: int = 3,
                        name: str = "train", side: int = 56) -> Path:
    """``directory/name.jsonl`` plus its PNG images (``side`` pixels square); returns the JSONL path."""
    directory = Path(directory)
    (directory / name).mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        count = rng.randint(1, max_count)
        relative = f"{name}/{i}.png"
        draw_squares(count, rng, side=side, square=side * 12 // 56).save(directory / relative)
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                     "images": [relative], "answer": str(count), "response": str(count)})
    out = directory / f"{name}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


class CountingEnv:
    """Reward 1 when the response's first digit is the answer, else 0 (metric ``correct``)."""

    def step(self, samples: Sequence[Sample], histories: Sequence[Sequence[str]]) -> list[EnvStep]:
        steps = []
        for sample, history in zip(samples, histories):
            found = re.search(r"\d", history[-1] if history else "")
            correct = float(found is not None and found.group(0) == str(sample.answer))
            steps.append(EnvStep(reward=correct, metrics={"correct": correct}))
        return steps


def counting_env(config: Any = None, *_: Any) -> CountingEnv:
    return CountingEnv()
