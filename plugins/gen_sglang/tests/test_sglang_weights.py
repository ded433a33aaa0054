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


# What the scheduler does with a payload, in a process of its own (a CUDA IPC handle does not open in the process
# that made it): rebuild the bucket, and save its tensors on the host for the test to compare.
READ_BACK = """
import sys, torch
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
monkey_patch_torch_reductions()  # as SGLang's model runner does at start-up: the payload names its rebuild function
data = MultiprocessingSerializer.deserialize(open(sys.argv[1], "rb").read())
bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
torch.save([(name, tensor.is_cuda, tensor.cpu()) for name, tensor in bucket.reconstruct_tensors()], sys.argv[2])
"""


@pytest.mark.skipif(not HAS_SGLANG or not torch.cuda.is_available(),
                    reason="needs sglang and a CUDA GPU (no CPU build on the package index; the GPU check installs "
                    "sglang 0.5.17: benchmarks/gpu/README.md)")
def test_sglangs_bucket_rebuilds_each_dtype_group_after_serialization(tmp_path):
    """SGLang's own FlattenedTensorBucket and MultiprocessingSerializer (host tensors are copied to the GPU
    first: SGLang's patched reducer takes CUDA tensors only), read back in another process as the scheduler
    reads them; a mixed-dtype bucket of the same tensors fails to rebuild."""
    import subprocess
    import sys

    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from rlcore_sglang.weights import bucket_payload

    for i, group in enumerate(by_dtype(mixed_chunk())):
        payloads, buffer = bucket_payload(group, tp_size=2)  # the buffer stays alive while the reader opens it
        assert len(payloads) == 2 and buffer.is_cuda
        sent, got = tmp_path / f"payload-{i}", tmp_path / f"rebuilt-{i}.pt"
        sent.write_bytes(payloads[1])
        done = subprocess.run([sys.executable, "-c", READ_BACK, str(sent), str(got)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        rebuilt = torch.load(got)
        assert [n for n, _, _ in rebuilt] == [n for n, _ in group]
        assert all(on_gpu and torch.equal(tensor, want) for (_, on_gpu, tensor), (_, want) in zip(rebuilt, group))
    mixed = FlattenedTensorBucket(named_tensors=mixed_chunk())
    with pytest.raises(RuntimeError, match="must be divisible"):
        FlattenedTensorBucket(flattened_tensor=mixed.get_flattened_tensor(), metadata=mixed.get_metadata()).reconstruct_tensors()
