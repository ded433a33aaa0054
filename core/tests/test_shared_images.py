"""Images several sequences share (a GRPO group's samples carry their prompt's images object): which
rows the vision tower encodes once, and how its outputs are copied back to every sequence's rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlcore.interfaces import SequenceBatch
from rlcore.data.multimodal import ImageInputs, SharedImages
from rlcore.data.packing import make_micro_batches, plan_micro_batches


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


def test_an_image_prompts_samples_are_packed_together():
    """Three image prompts, two samples each (prompt ids, then responses of 3 to 14 tokens): plain best
    fit would pair samples of different prompts; the prompt ids as affinity keys keep each pair in one
    micro-batch, in as many micro-batches."""
    prompts = [list(range(100, 108)), list(range(200, 209)), list(range(300, 310))]
    responses = [3, 9, 14, 13, 12, 1]
    ids = [torch.tensor(prompts[i // 2] + [7] * r) for i, r in enumerate(responses)]
    masks = [torch.tensor([0.0] * len(prompts[i // 2]) + [1.0] * r) for i, r in enumerate(responses)]
    plain = plan_micro_batches([len(x) for x in ids], 48)[0]
    assert any(len({i // 2 for i in mb}) > 1 for mb in plain)
    per_prompt = [_images(0, [1, 2, 2]), _images(10, [1, 2, 2]), _images(20, [1, 2, 2])]
    batch = SequenceBatch(input_ids=ids, loss_mask=masks, images=[per_prompt[i // 2] for i in range(6)])
    micro_batches = make_micro_batches(batch, 48)
    assert sorted(sorted(mb.seq_ids) for mb in micro_batches) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("seed", range(5))
def test_affinity_packs_groups_into_few_micro_batches_at_the_same_fill(seed):
    """16 prompts x 8 samples of 300-800 tokens into 4096-token micro-batches: keyed by prompt, the step
    encodes about a third as many images, with at most one micro-batch more than plain best fit."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(300, 800, size=128).tolist()
    keys = [i // 8 for i in range(128)]
    plain = plan_micro_batches(lengths, 4096)[0]
    keyed = plan_micro_batches(lengths, 4096, affinity=keys)[0]
    assert sorted(i for mb in keyed for i in mb) == list(range(128))
    assert all(sum(lengths[i] for i in mb) <= 4096 for mb in keyed)
    assert len(keyed) <= len(plain) + 1

    def encodings(plan):
        return sum(len({keys[i] for i in mb}) for mb in plan)

    assert encodings(keyed) * 2 < encodings(plain)


def test_a_tower_inside_encode_each_once_sees_distinct_rows_and_refuses_other_inputs():
    from rlcore.data.multimodal import encode_each_once

    a, b = _images(0, [1, 2, 2]), _images(10, [1, 2, 2])
    shared = SharedImages.find([a, a, b], merge_size=2)
    tower = torch.nn.Linear(1, 3)
    seen = []
    tower.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    pixels = torch.cat([a.pixel_values, a.pixel_values, b.pixel_values])
    with encode_each_once(tower, shared):
        out = tower(pixels)
        with pytest.raises(ValueError, match="got 4 rows of pixels, the sequences' images have 12"):
            tower(a.pixel_values)
    assert torch.equal(out, tower(pixels))  # the hooks are gone: all 12 rows encoded
    assert seen == [8, 12]
