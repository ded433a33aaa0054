"""Image rows of a JSONL dataset: each kind of bad image is an error naming the file and row, or a
counted skip with ``skip_bad_images``; good rows keep their images beside their prompt ids."""

from __future__ import annotations

import base64
import io
import json

import pytest

pytest.importorskip("PIL")

from rlcore.data.image_data import build_image_dataset, write_counting_task  # noqa: E402
from rlcore.data.multimodal import ImageError, ImagePromptProcessor  # noqa: E402

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many squares?"}]}]


@pytest.fixture(scope="module")
def processor():
    from rlcore.testing.tiny_vlm import build_image_processor, build_vlm_tokenizer

    return ImagePromptProcessor(build_vlm_tokenizer(), build_image_processor())


def _png_bytes(size=(56, 56)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, "white").save(out, format="PNG")
    return out.getvalue()


def _write(tmp_path, images: list[str]):
    good = tmp_path / "good.png"
    good.write_bytes(_png_bytes())
    rows = [{"messages": MESSAGES, "images": ["good.png"], "answer": "1"},
            {"messages": MESSAGES, "images": images, "answer": "2"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _missing(tmp_path):
    return ["nowhere.png"], "does not exist"


def _not_an_image(tmp_path):
    (tmp_path / "notes.png").write_text("these are words, not pixels")
    return ["notes.png"], "not an image"


def _truncated(tmp_path):
    (tmp_path / "cut.png").write_bytes(_png_bytes()[:60])
    return ["cut.png"], "truncated or corrupt"


def _huge(tmp_path):
    (tmp_path / "huge.png").write_bytes(_png_bytes((300, 300)))
    return ["huge.png"], "more than the 10000 pixels allowed"


def _bad_base64(tmp_path):
    return ["data:image/png;base64,@@@not-base64@@@"], "not valid base64"


def _base64_not_an_image(tmp_path):
    return ["data:image/png;base64," + base64.b64encode(b"plain text").decode()], "not an image"


@pytest.mark.parametrize("case", [_missing, _not_an_image, _truncated, _huge, _bad_base64, _base64_not_an_image])
def test_bad_image_names_file_and_row_or_is_skipped(tmp_path, processor, case):
    refs, message = case(tmp_path)
    path = _write(tmp_path, refs)
    with pytest.raises(ImageError, match=message) as info:
        build_image_dataset(path, processor, max_image_pixels=10_000)
    assert f"{path}:2" in str(info.value)
    dataset = build_image_dataset(path, processor, skip_bad_images=True, max_image_pixels=10_000)
    assert dataset.skipped == 1 and [s.answer for s in dataset.train] == ["1"]


def test_base64_and_path_images_give_the_same_prompt(tmp_path, processor):
    import torch

    inline = "data:image/png;base64," + base64.b64encode(_png_bytes()).decode()
    dataset = build_image_dataset(_write(tmp_path, [inline]), processor)
    first, second = dataset.train
    assert first.prompt_ids == second.prompt_ids
    assert torch.equal(first.images.pixel_values, second.images.pixel_values)


def test_image_count_must_match_the_messages(tmp_path, processor):
    path = _write(tmp_path, ["good.png", "good.png"])
    with pytest.raises(ValueError, match=r"rows.jsonl:2: the messages hold 1 image entries but 2 images"):
        build_image_dataset(path, processor)


def test_counting_task_is_seeded(tmp_path):
    a = write_counting_task(tmp_path / "a", 5, seed=4).read_text()
    b = write_counting_task(tmp_path / "b", 5, seed=4).read_text()
    assert a == b
    assert (tmp_path / "a" / "train" / "0.png").read_bytes() == (tmp_path / "b" / "train" / "0.png").read_bytes()


def test_image_prompts_need_a_generator_that_takes_images(tmp_path, processor):
    from rlcore.controller.rollouts import image_generator, no_images_in_multi_turn

    class TextOnly:
        def generate(self, prompts, params): ...

    with pytest.raises(TypeError, match="generator TextOnly takes none"):
        image_generator(TextOnly())
    samples = build_image_dataset(_write(tmp_path, ["good.png"]), processor).train
    with pytest.raises(ValueError, match=r"samples \[0, 1\] carry images, but multi-turn rollouts take text prompts only"):
        no_images_in_multi_turn(samples)


def test_counting_images_have_the_side_asked_for(tmp_path):
    from PIL import Image

    write_counting_task(tmp_path, 2, side=112)
    with Image.open(tmp_path / "train" / "0.png") as image:
        assert image.size == (112, 112)
