"""A refit into SGLang: Hugging Face-named chunks through ``update_weights_from_tensor``.

Each chunk (already bounded by ``policy.generation.refit.chunk_bytes``) becomes one
``FlattenedTensorBucket`` per dtype in it (its tensors back to back in one uint8 buffer), sent with
``load_format="flattened_bucket"``: one CUDA IPC handle a chunk instead of one a tensor (a refit in the
engine's dtype has one dtype). The engine's
scheduler rebuilds the tensors from the buffer and calls the model's ``load_weights`` with them, which
maps Hugging Face names to its own layout (``sglang/srt/model_executor/model_runner_components/
weight_updater.py``: ``_update_weights_from_flattened_bucket``). This is how slime sends its colocated
refits (``slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py``).

Every tensor-parallel rank gets its own copy of the serialized payload (``Engine._serialize_tensors_per_rank``
does the same for unflattened tensors). CUDA tensors travel as IPC handles naming their GPU by UUID:
``monkey_patch_torch_reductions`` makes torch's reducer write the UUID, which the scheduler's patched
rebuild reads (``sglang/srt/weight_sync/utils.py`` patches the sender the same way). That patched reducer
takes every tensor for a CUDA one (sglang 0.5.17 fails on a CPU tensor's shorter reduce tuple: "tuple index
out of range"), so a bucket of host tensors (a checkpoint read on the CPU) is copied to the current GPU first.

The caller keeps the buffers alive until the last chunk has loaded and the cache is flushed: SGLang
answers once its copies into the weights are enqueued, not finished (slime's
``_build_flattened_tensor_data`` notes the race a reused buffer would cause).
"""

from __future__ import annotations

from typing import Any

from rlcore.interfaces import NamedTensors


def by_dtype(chunk: NamedTensors) -> list[NamedTensors]:
    """The chunk's tensors grouped by dtype, in order of first appearance.

    ``FlattenedTensorBucket`` lays tensors back to back in bytes with no padding and rebuilds each
    with ``.view(dtype)``, which needs its offset to be a multiple of the dtype's size: a float64 after
    seven bfloat16 values fails there ("storage_offset() must be divisible by 8"). In one dtype every
    offset is a whole number of elements (slime also sends one bucket per dtype where SGLang's bucket
    is not known to take several)."""
    groups: dict = {}
    for name, tensor in chunk:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    return list(groups.values())


def bucket_payload(named: NamedTensors, tp_size: int) -> tuple[list[bytes], Any]:
    """(one serialized ``{"flattened_tensor", "metadata"}`` per tensor-parallel rank, the buffer to keep
    alive) for tensors of one dtype (:func:`by_dtype`).

    Runs in the caller's thread (the trainer's CUDA device and stream); the copy into the buffer is
    finished before its handle leaves, since the engine reads it on a stream of its own."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()
    bucket = FlattenedTensorBucket(named_tensors=[(name, tensor.detach()) for name, tensor in named])
    buffer = bucket.get_flattened_tensor()
    if not buffer.is_cuda:  # see the module's text: only CUDA tensors go through SGLang's reducer
        buffer = buffer.to(torch.cuda.current_device())
    torch.cuda.current_stream(buffer.device).synchronize()
    data = {"flattened_tensor": buffer, "metadata": bucket.get_metadata()}
    return [MultiprocessingSerializer.serialize(data) for _ in range(tp_size)], buffer


async def send_bucket(manager, payloads: list[bytes], what: str) -> None:
    """One ``update_weights_from_tensor`` through the tokenizer manager ``manager`` (no cache flush: the
    refit flushes once at its end). A chunk the engine refuses raises with SGLang's message."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format="flattened_bucket",
                                              flush_cache=False)
    success, message = await manager.update_weights_from_tensor(request, None)
    if not success:
        raise RuntimeError(f"SGLang refused the refit's {what}: {message}")
