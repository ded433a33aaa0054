"""CPU shims that let megatron-core (0.16.1 and 0.19.x) run without a GPU (development and CI, over gloo).

Active only when no CUDA device is in use: :func:`install` returns at once when
``torch.cuda.is_available()``. Everything megatron-core assumes about CUDA and that matters on
CPU is patched here, in one place, so the rest of the plugin is the GPU code path:

- ``torch.cuda.current_device()`` answers ``"cpu"`` and ``torch.cuda.synchronize()`` does
  nothing (the schedules, timers and the distributed optimizer call them).
- A :class:`torch.overrides.TorchFunctionMode` rewrites tensor factory calls and ``.to``/``.cuda``
  moves that name a CUDA device to the CPU: the pipeline schedules and the default causal mask
  hard-code ``device="cuda"``. It is entered around each backend call (:func:`active`,
  :func:`shimmed`), not for the whole process.
- ``Tensor.type()`` reports CPU tensors as ``torch.cuda.*Tensor``: Megatron's optimizers accept
  only those type strings.
- ``torch.cuda.Stream``/``current_stream``/``stream`` give one do-nothing CPU stream (MoE token
  dispatch moves routing counts to the host on a side stream).
- MoE all-to-all split sizes are turned into host numbers as on GPU.
- The CUDA RNG tracker becomes one whose ``fork()`` is a no-op (CPU has one generator; dropout
  is off in RL fine-tuning anyway), and the CUDA RNG state getters/setters used by activation
  recomputation read and write the CPU generator instead.

Models must be built with ``use_cpu_initialization=True`` (the backend sets it on CPU).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device in torch's factories
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Sends every tensor that code asks to put on a CUDA device to the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda(...)
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:  # Tensor.type(): the optimizers check for CUDA types
            result = func(*args)
            return result.replace("torch.", "torch.cuda.", 1) if result.startswith("torch.") and ".cuda." not in result else result
        if name == "to" and args:
            args = tuple("cpu" if _is_cuda(a) and not isinstance(a, int) else a for a in args)
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Stand-in for megatron's CudaRNGStatesTracker: records seeds, ``fork()`` changes nothing."""

    def __init__(self, *args, **kwargs):
        self.states_: dict[str, int] = {}
        self.seeds_: set[int] = set()
        self.use_cudagraphable_rng = False

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self.states_[name] = seed
        self.seeds_.add(seed)

    def fork(self, name: str = "model-parallel-rng"):
        return contextlib.nullcontext()


class _CpuEvent:
    def synchronize(self) -> None: ...

    def wait(self, *args) -> None: ...

    def query(self) -> bool:
        return True


class CpuStream:
    """The one CPU "stream": MoE token dispatch copies routing counts on a side CUDA stream."""

    def wait_stream(self, other) -> None: ...

    def wait_event(self, event) -> None: ...

    def record_event(self, event=None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None: ...

    def __eq__(self, other) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0


_STREAM = CpuStream()


def _move_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's ``maybe_move_tensor_to_cpu`` converts to numpy only for CUDA tensors; the
    all-to-all split sizes must be host numbers on CPU too."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def cuda_in_use() -> bool:
    return torch.cuda.is_available()


def install() -> bool:
    """Apply the shims once per process if there is no CUDA device; returns whether they are active."""
    global _INSTALLED
    if cuda_in_use():
        return False
    if _INSTALLED:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.initialize_rng_tracker = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: None
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.Stream = CpuStream
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = _move_to_host
    _INSTALLED = True
    return True


def active():
    """Context in which megatron code runs: the CUDA->CPU function mode when the shims are installed.

    The mode is entered per backend call rather than for the whole process, so other code in the
    same process (a colocated generator, other tests) runs unaffected and at full speed.
    """
    return CudaToCpuMode() if _INSTALLED else contextlib.nullcontext()


def shimmed(method):
    """Decorator for backend methods: run them inside :func:`active`."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with active():
            return method(*args, **kwargs)

    return wrapper


def shimmed_iter(iterator):
    """Advance ``iterator`` inside :func:`active`, yield its items outside it."""
    while True:
        with active():
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item
