"""What a colocated engine's wake-up needs of the GPU, checked before SGLang maps it back.

SGLang's memory saver maps the released weights and KV cache back outside torch's allocator; on a
GPU without room for them the engine's scheduler process fails with CUDA's out-of-memory error and
takes the run with it. So the generator measures what each sleep gave back and refuses a wake-up,
naming what holds the GPU and the keys that make room, when less is free.
"""

from __future__ import annotations

GIB = float(1 << 30)


def free_gpu_bytes() -> int:
    """Free memory of this process's GPU, every process's use counted (the engine's is another's)."""
    import torch

    return int(torch.cuda.mem_get_info()[0])


def wake_up_refusal(need: int, free: int, fraction: float, part: str = "weights and KV cache") -> str:
    """The refusal: what the engine needs, what is free, what this process's allocator holds, the fix."""
    import torch

    total = torch.cuda.mem_get_info()[1]
    held = torch.cuda.memory_allocated()
    cached = torch.cuda.memory_reserved() - held
    return (f"SGLang cannot wake up: its {part} take {need / GIB:.1f} GiB and the GPU has {free / GIB:.1f} of "
            f"{total / GIB:.1f} GiB free (the engine's share, policy.generation.gpu_memory_utilization, is {fraction:.2f}); "
            f"this process's tensors hold {held / GIB:.1f} GiB and its allocator caches {cached / GIB:.1f} GiB more "
            "(the trainer's state and what its last phase left). To fit: policy.generation.colocated.offload_trainer_state: "
            "true (or auto), or a smaller policy.generation.gpu_memory_utilization")
