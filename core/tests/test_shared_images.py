"""Images several sequences share (a GRPO group's samples carry their prompt's images object): which
rows the vision tower encodes once, and how its outputs are copied back to every sequence's rows."""

from __future__ import annotations

import pytest
import torch

from rlcore.interfaces import SequenceBatch
from rlcore.multimodal import ImageInputs, SharedImages
from rlcore.packing import make_micro_batches


def _images(first: float, grid: list[int]) -> ImageInputs:
    patches = grid[0] * grid[1] * grid[2]
    return ImageInputs(first + torch.arange(float(patches))[:, None], torch.tensor([grid]))


def test_distinct_rows_in_and_every_row_back_out():
    a, b = _images(0, [1, 4, 4]), _images(100, [1, 4, 8])
    assert SharedImages.find([a, b, None]) is None  # nothing shared
    shared = SharedImages.find([a, a, b, None, b], merge_size=2)
    full = torch.cat([a.pixel_values, a.pixel_values, b.pixel_values, b.pixel_values])
    distinct = full.index_select(0, shared.unique_rows)
    assert torch.equal(distinct, torch.cat([a.pixel_values, b.pixel_values]))
    assert torch.equal(shared.unique_grid_I3, torch.tensor([[1, 4, 4], [1, 4, 8]]))
    # patch-level outputs, merged-token outputs (2x2 merge: 4 patches a token), and a ModelOutput-like mix
    assert torch.equal(shared.expand(distinct), full)
    merged = distinct.view(-1, 4).sum(1)
    assert torch.equal(shared.expand(merged), full.view(-1, 4).sum(1))
    out = shared.expand({"pooler_output": merged, "deepstack": [merged, merged]})
    assert torch.equal(out["deepstack"][1], full.view(-1, 4).sum(1))
    with pytest.raises(ValueError, match=r"output\.hidden: leading size \(5,\)"):
        shared.expand({"hidden": torch.zeros(5, 1)})


def test_fixed_resolution_images_are_shared_per_image():
    a, b = ImageInputs(torch.zeros(1, 3, 4, 4)), ImageInputs(torch.ones(2, 3, 4, 4))
    shared = SharedImages.find([b, a, b])
    assert shared.unique_rows.tolist() == [0, 1, 2] and shared.unique_grid_I3 is None
    encoded = torch.tensor([[10.0], [11.0], [20.0]])  # one row per distinct image: b's two, then a's
    assert shared.expand(encoded).flatten().tolist() == [10.0, 11.0, 20.0, 10.0, 11.0]


def test_moving_a_micro_batch_keeps_shared_images_shared():
    a, b = _images(0, [1, 2, 2]), _images(50, [1, 2, 2])
    batch = SequenceBatch(input_ids=[torch.arange(6)] * 4, loss_mask=[torch.ones(6)] * 4, images=[a, a, b, None])
    (mb,) = make_micro_batches(batch, 64)
    moved = mb.to("cpu").images
    assert moved[0] is moved[1] and moved[0] is not a and moved[2] is not moved[0] and moved[3] is None
