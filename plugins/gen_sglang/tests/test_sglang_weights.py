"""The refit's buckets: one dtype each, so SGLang can rebuild every tensor from the flat buffer."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlcore_sglang.weights import by_dtype

HAS_SGLANG = importlib.util.find_spec("sglang") is not None


def mixed_chunk():
    return [("a.weight", torch.randn(3, 5)), ("b.bias", torch.arange(7, dtype=torch.bfloat16)),
            ("c", torch.randn(2, 2, dtype=torch.float64).t()), ("d", torch.randn(5)), ("e", torch.ones(3, dtype=torch.bfloat16))]


def test_buckets_hold_one_dtype_in_order_so_every_offset_is_whole_elements():
    groups = by_dtype(mixed_chunk())
    assert [[n for n, _ in g] for g in groups] == [["a.weight", "d"], ["b.bias", "e"], ["c"]]
    for group in groups:
        assert len({t.dtype for _, t in group}) == 1
        offset = 0
        for _, tensor in group:
            assert offset % tensor.element_size() == 0
            offset += tensor.numel() * tensor.element_size()
    assert by_dtype([]) == []


@pytest.mark.skipif(not HAS_SGLANG or not torch.cuda.is_available(),
                    reason="needs sglang and a CUDA GPU (no CPU build on the package index; the GPU check installs "
                    "sglang 0.5.17: benchmarks/gpu/README.md)")
def test_sglangs_bucket_rebuilds_each_dtype_group_after_serialization():
    """SGLang's own FlattenedTensorBucket and MultiprocessingSerializer (host tensors are copied to the GPU
    first: SGLang's patched reducer takes CUDA tensors only), as the scheduler reads them back; a mixed-dtype
    bucket of the same tensors fails to rebuild."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from rlcore_sglang.weights import bucket_payload

    for group in by_dtype(mixed_chunk()):
        payloads, _ = bucket_payload(group, tp_size=2)
        assert len(payloads) == 2
        data = MultiprocessingSerializer.deserialize(payloads[1])
        bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
        rebuilt = bucket.reconstruct_tensors()
        assert [n for n, _ in rebuilt] == [n for n, _ in group]
        assert all(got.is_cuda and torch.equal(got.cpu(), want) for (_, got), (_, want) in zip(rebuilt, group))
    mixed = FlattenedTensorBucket(named_tensors=mixed_chunk())
    with pytest.raises(RuntimeError, match="must be divisible"):
        FlattenedTensorBucket(flattened_tensor=mixed.get_flattened_tensor(), metadata=mixed.get_metadata()).reconstruct_tensors()
