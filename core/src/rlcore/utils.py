"""Small helpers that several parts of rlcore and its plugins need, written once.

Imports no torch at import time (``torch_dtype`` imports it when called).
"""

from __future__ import annotations

import importlib
import random
import socket
from pathlib import Path
from typing import Any

# The dtypes a recipe may name (policy.precision, generation dtypes, pipeline dtypes).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a process group's store or a local listener).

    Chosen at random between 20000 (above Ray's worker ports, 10002-19999 by default) and the kernel's
    ephemeral range: a port the kernel hands out (bind to 0) is one it also gives to other processes'
    outgoing connections, which busy processes (gloo's pairs, Ray) open all the time, so it can be
    taken before the listener binds it."""
    low = _ephemeral_ports_start()
    chooser = random.Random()  # seeded from the OS: two processes draw independently
    for _ in range(64):
        port = chooser.randrange(20_000, low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # that range is busy: let the kernel choose
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > 21_000 else 32768


def resolve(spec: str) -> Any:
    """The object a ``"module:attr"`` string names (``attr`` may be dotted); imported on call."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:attr', got {spec!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def torch_dtype(dtype: Any):
    """A ``torch.dtype`` from one of :data:`DTYPE_NAMES` (``"torch."`` prefix allowed), a
    ``torch.dtype`` (returned as is) or None / ``"auto"`` (None)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return None
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {list(DTYPE_NAMES)} or a torch.dtype")
    return getattr(torch, name)


def in_daemon_thread(fn, name: str = "rlcore-worker"):
    """``fn()`` in a daemon thread; a :class:`concurrent.futures.Future` of its result. Daemon: a
    call left blocked by a dead peer (a refit receive) must not keep the process alive."""
    import concurrent.futures
    import threading

    future: concurrent.futures.Future = concurrent.futures.Future()

    def target():
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(exc)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


def local_model_dir(name: str) -> str:
    """``name`` when it is a directory, else the local snapshot of the Hugging Face hub model
    ``name`` in huggingface_hub's cache (fetched when the hub can be reached, read from the cache
    when not): for code that reads a model's files itself rather than through ``from_pretrained``."""
    from pathlib import Path

    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    from huggingface_hub import snapshot_download

    return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"])
