"""Fixtures rlcore ships to any pytest run where rlcore is installed (entry point pytest11).

Heavy imports stay inside the fixtures. Models are built once per session.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from rlcore.testing.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved random-init tiny Llama (fp32) with its tokenizer; returns the directory."""
    from rlcore.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``factory(arch, **config_kwargs) -> path``; each (arch, kwargs) is built once per session."""
    from rlcore.testing.tiny import build_tiny_model

    cache: dict = {}

    def factory(arch: str = "llama", **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="module")
def single_process_group():
    """A world-size-1 gloo process group, as a training backend expects to find (reuses one
    that is already initialized and leaves it alone)."""
    import torch.distributed as dist

    from rlcore.utils import free_port

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def single_cuda_process_group():
    """A world-size-1 NCCL process group on ``cuda:0`` for the CUDA-only tests (reuses one that is
    already initialized and leaves it alone). One per session: Megatron's parallel state keeps the
    groups it made from the first world, so a second world in the same process fails in Megatron
    ("Group ... is not registered", seen when two CUDA test modules ran in one session)."""
    import torch
    import torch.distributed as dist

    from rlcore.controller.workers import free_port

    if dist.is_initialized():
        yield
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB file system (tmpfs): a run's small files fit, the tiny model (1.3 MB) does not.
    Mounting needs root (else the test is skipped); core/tests/test_checkpoint_safety.py injects the
    error instead."""
    import os
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("a real full disk needs a tmpfs mount (root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)
