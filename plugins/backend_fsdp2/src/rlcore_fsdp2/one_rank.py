"""FSDP2 with one data-parallel rank: cheaper gradient copy-in and accumulation.

**Copy-in.** Before each reduce-scatter FSDP2 copies a module's gradients into one flat buffer with
``torch._chunk_cat``. Its CUDA kernel builds its launch metadata on the host, one entry per
block of the copy: for the 1.2B Llama of ``benchmarks/bench_train_fsdp2.py`` that is tens of
milliseconds of host time per optimizer step (one call, all parameters at the root), during which
the GPU sits idle (about a tenth of the step). With
one rank there is one chunk, and ``_chunk_cat`` with one chunk is ``torch.cat`` of the flattened
gradients (same values, same dtype cast into the buffer), whose launch costs microseconds.

**Accumulation.** With the gradient sync deferred over a step's micro-batches, FSDP2 keeps one
float32 accumulator per parameter: it upcasts the first micro-batch's bf16 gradients and adds
each later one with a ``+=`` per parameter. Mixed-dtype ``+=`` runs torch's non-vectorized
element-wise kernel (at 1.2B parameters, several percent of a 16-micro-batch step). :func:`accumulate_group` does both for all of a module's parameters in one
``torch.compile``'d foreach call before FSDP2's own post-backward runs, which then finds the
gradients already folded in (about 3% less step time at 4 micro-batches). On CPU it runs torch's eager foreach ops (same values).

:func:`install` wraps FSDP2's copy-in function (a module-level function that ``foreach_reduce``
looks up at each call; one chunk goes through ``torch.cat``, several through FSDP2's own code)
and ``FSDPParamGroup.post_backward`` (parameter groups on a one-rank mesh only). Written here
because no FSDP2 option changes either.

**Side effect and switch.** These are private FSDP2 names, replaced process-wide while a backend
that asked for them lives (every FSDP2 model of the process goes through the wrappers; groups on
meshes of more than one rank, or offloaded ones, take FSDP2's own path unchanged): :func:`install`
counts its callers and :func:`uninstall` puts FSDP2's own functions back when the last one has
shut down. ``policy.dtensor_cfg.experimental.one_rank_fast_paths`` (default true) turns it off.
Checked against :data:`CHECKED_TORCH`;
``tests/test_fsdp2_conformance.py::test_one_rank_replaces_what_this_torch_has`` fails when a torch
release moves or changes them, and a torch without them is left alone (logged) at run time.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from rlcore.training.compiling import CompiledOrEager

log = logging.getLogger(__name__)

_ORIGINAL_ATTR = "_rlcore_original"
_users = 0  # backends that installed the wrappers and have not shut down
# torch releases whose FSDP2 internals these wrappers were read against and measured on
# (2.11 with CUDA, 2.13 on CPU).
CHECKED_TORCH = ("2.11", "2.13")


def copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int,
            original: Any = None) -> None:
    """``foreach_reduce_scatter_copy_in`` with a ``torch.cat`` path for one chunk."""
    if world_size == 1:
        torch.cat([grad.reshape(-1) for grad in unsharded_grads], out=reduce_scatter_input.view(-1))
        return
    original(unsharded_grads, reduce_scatter_input, world_size)


def _foreach_add(accs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    torch._foreach_add_(accs, grads)


def _upcast(grads: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [grad.to(dtype) for grad in grads]


_KERNELS = CompiledOrEager("fsdp2 backend: gradient accumulation",
                           {"add": (_foreach_add, _foreach_add), "upcast": (_upcast, _upcast)}, dynamic=False)


def accumulate_group(group: Any, compiled: bool | None = None) -> None:
    """Fold a parameter group's new unsharded gradients into FSDP2's float32 accumulators.

    Parameters with an accumulator get ``acc += grad``; without one, while the sync is deferred
    (``reduce_grads`` false) and the gradient is not in the reduce dtype yet, the accumulator is
    created from the upcast gradient. Each handled gradient is dropped, as FSDP2 does. When the
    sync is on and no accumulator exists, FSDP2 reduces the gradient itself."""
    adds: list[tuple[Any, torch.Tensor]] = []
    fresh: list[tuple[Any, torch.Tensor]] = []
    for fsdp_param in group.fsdp_params:
        param = getattr(fsdp_param, "_unsharded_param", None)
        grad = None if param is None else param.grad
        if grad is None:
            continue
        if fsdp_param.unsharded_accumulated_grad is not None:
            adds.append((fsdp_param, grad))
        elif not group.reduce_grads and fsdp_param.reduce_dtype not in (None, grad.dtype):
            fresh.append((fsdp_param, grad))
    if not adds and not fresh:
        return
    on_cuda = (adds or fresh)[0][1].is_cuda
    compiled = on_cuda if compiled is None else compiled
    if adds:
        _KERNELS.run("add", compiled, [p.unsharded_accumulated_grad for p, _ in adds], [g for _, g in adds])
    by_dtype: dict[torch.dtype, list[tuple[Any, torch.Tensor]]] = {}
    for fsdp_param, grad in fresh:
        by_dtype.setdefault(fsdp_param.reduce_dtype, []).append((fsdp_param, grad))
    for dtype, pairs in by_dtype.items():
        upcast = _KERNELS.run("upcast", compiled, [g for _, g in pairs], dtype)
        for (fsdp_param, _), acc in zip(pairs, upcast):
            fsdp_param.unsharded_accumulated_grad = acc
    for fsdp_param, _ in adds + fresh:
        fsdp_param._unsharded_param.grad = None


def _on_one_rank(group: Any) -> bool:
    mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
    offloaded = any(getattr(p, "offload_to_cpu", False) for p in group.fsdp_params)
    return mesh is not None and mesh.size() == 1 and not offloaded


def install() -> bool:
    """Wrap FSDP2's copy-in and post-backward (once per process; each True call is paired with an
    :func:`uninstall`); False where this torch has neither."""
    global _users
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        log.warning("fsdp2 backend: this torch (%s) has no FSDP2 internals one_rank_fast_paths replaces; left as is",
                    torch.__version__)
        return False
    copy_in_done = _wrap(collectives, "foreach_reduce_scatter_copy_in",
                         lambda current: lambda grads, buffer, world_size: copy_in(grads, buffer, world_size, current))
    accumulate_done = _wrap(FSDPParamGroup, "post_backward", _post_backward_accumulating_first)
    installed = copy_in_done or accumulate_done
    _users += installed
    return installed


def uninstall() -> None:
    """Release one :func:`install`; the last release puts FSDP2's own functions back."""
    global _users
    _users = max(0, _users - 1)
    if _users:
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    for owner, name in ((collectives, "foreach_reduce_scatter_copy_in"), (FSDPParamGroup, "post_backward")):
        original = getattr(getattr(owner, name, None), _ORIGINAL_ATTR, None)
        if original is not None:
            setattr(owner, name, original)


def _post_backward_accumulating_first(current: Any) -> Any:
    def post_backward(self, *unused):
        if _on_one_rank(self):
            accumulate_group(self)
        return current(self, *unused)

    return post_backward


def _wrap(owner: Any, name: str, wrapper_for: Any) -> bool:
    """Replace ``owner.name`` with ``wrapper_for(original)`` unless already wrapped; False where
    this torch has no such name."""
    current = getattr(owner, name, None)
    if current is None:
        log.debug("fsdp2 backend: this torch has no %s.%s; left as is", getattr(owner, "__name__", owner), name)
        return False
    if not hasattr(current, _ORIGINAL_ATTR):
        wrapped = wrapper_for(current)
        setattr(wrapped, _ORIGINAL_ATTR, current)
        setattr(owner, name, wrapped)
    return True
