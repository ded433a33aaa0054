"""Methods added to every vLLM worker (``worker_extension_cls``), reached by ``collective_rpc``.

A refit is ``rlcore_begin_update`` -> ``rlcore_load`` per chunk -> ``rlcore_finish_update``:
vLLM's layer-wise reload (the machinery behind ``model_runner.reload_weights``) takes Hugging
Face-named checkpoint tensors, re-runs each layer's post-load processing (CPU weight repacking,
fused QKV/gate-up) once all of a layer's tensors arrived, and copies the result into the live
kernel tensors, so CUDA graphs and the KV cache stay valid. Loading into ``model.load_weights``
without it fails on CPU (weights were repacked after loading).

Older vLLM builds without ``model_loader.reload`` fall back to collecting the chunks and calling
``model_runner.reload_weights(weights_iterator=...)`` once at the end.

Layers that hold no weights, only state derived from the config (a ``RotaryEmbedding``'s
``cos_sin_cache``, a non-persistent buffer no checkpoint carries: Hugging Face models drop their
``rotary_emb.inv_freq`` from checkpoints, and vLLM's ``load_weights`` skips the name), are kept out
of the reload (:func:`keep_derived_layers_out`). vLLM's layer-wise reload counts every buffer as
loadable, so otherwise it expects tensors for them that no refit can send, puts their kept tensors
back at the end and logs "RotaryEmbedding: Failed to load weights" after every refit: a false
alarm that reads as a failed weight sync.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from typing import Any
from urllib.parse import urlsplit

from rlcore_vllm.codecs import decode

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def keep_worker_store_on_this_machine() -> None:
    """vLLM's workers meet through ``torch.distributed.init_process_group(init_method="tcp://127.0.0.1:PORT")``,
    whose store server (c10d's TCPStore) listens on every interface whatever host the URL names: any
    machine that can reach this one could talk to it. A loopback URL means the ranks are all on this
    machine (and a single rank needs none), so the store becomes a file (``file://``) shared by them
    instead: nothing listens. Applied
    to vLLM's own calls only (the caller's module), in the processes that load this worker extension;
    URLs naming another host (a multi-node Ray executor) are left as they are."""
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_rlcore_loopback_store", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        method = kwargs.get("init_method")
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if isinstance(method, str) and method.startswith("tcp://") and caller.startswith("vllm."):
            parts = urlsplit(method)
            alone = kwargs.get("world_size", 1) == 1  # one rank needs no network, whatever address it names
            if (alone or parts.hostname in _LOOPBACK_HOSTS) and parts.port:
                # one name for every rank of this engine: its workers share the engine core as parent
                # (a single worker is the engine core's own process), and the port is unique while it lives
                owner = os.getpid() if alone else os.getppid()
                path = os.path.join(tempfile.gettempdir(), f"rlcore-vllm-store-{owner}-{parts.port}")
                kwargs["init_method"] = f"file://{path}"
        return original(*args, **kwargs)

    init_process_group._rlcore_loopback_store = True
    dist.init_process_group = init_process_group


keep_worker_store_on_this_machine()


def _layerwise():
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def keep_derived_layers_out(model) -> list[str]:
    """After ``initialize_layerwise_reload(model)``: give back, as they were, the layers whose only
    tensors are non-persistent buffers (derived from the config, never in a checkpoint), and mark
    them as not reloading, so the reload waits for no tensor of theirs. Returns their class names."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    kept = []
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or info.kernel_tensors is None:
            continue
        params, buffers = info.kernel_tensors
        if params or not buffers or not set(buffers) <= set(info.kernel_non_persistent_buffers):
            continue
        for name in list(layer._parameters) + list(layer._buffers):  # the meta placeholders of the reload
            delattr(layer, name)
        for name, buffer in buffers.items():
            layer.register_buffer(name, buffer, persistent=False)
        info.reset()  # not loading: the finalize pass leaves it alone
        kept.append(type(layer).__name__)
    return kept


class RlcoreWorkerExtension:
    """Mixed into vLLM's worker class; every name starts with ``rlcore_`` to avoid clashes."""

    def rlcore_begin_update(self) -> None:
        from vllm.config import set_current_vllm_config

        self.rlcore_pending = []
        self.rlcore_loaded = 0
        fns = _layerwise()
        self.rlcore_layerwise = fns is not None
        if fns is not None:
            with set_current_vllm_config(self.vllm_config):
                model = self.model_runner.get_model()
                fns[0](model)
                keep_derived_layers_out(model)

    def rlcore_load_tensors(self, named_tensors: list[tuple[str, Any]]) -> int:
        from vllm.config import set_current_vllm_config

        if not hasattr(self, "rlcore_layerwise"):
            raise RuntimeError("rlcore_load called outside a weight update (call rlcore_begin_update first)")
        named_tensors = [(n, t.to(self.device)) for n, t in named_tensors]
        if self.rlcore_layerwise:
            with set_current_vllm_config(self.vllm_config):
                self.rlcore_loaded += len(self.model_runner.get_model().load_weights(named_tensors) or ())
        else:
            self.rlcore_pending.extend(named_tensors)
        return sum(t.numel() * t.element_size() for _, t in named_tensors)

    def rlcore_load(self, payload: dict[str, Any]) -> int:
        return self.rlcore_load_tensors(decode(payload))

    def rlcore_finish_update(self) -> int:
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            if self.rlcore_layerwise:
                _layerwise()[1](model, self.model_config)
            else:
                self.model_runner.reload_weights(weights_iterator=iter(self.rlcore_pending))
        loaded = self.rlcore_loaded
        del self.rlcore_pending, self.rlcore_layerwise, self.rlcore_loaded
        return loaded

    # ---- broadcast group (non-colocated refit) ------------------------------------------------
    def rlcore_join_weight_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str,
                                 timeout_s: float) -> int:
        from rlcore_vllm.broadcast import WeightGroup

        import torch

        parallel = self.vllm_config.parallel_config  # data-parallel replicas each have local ranks 0..TP*PP-1
        rank = rank_offset + parallel.data_parallel_rank * parallel.world_size + getattr(self, "rank", 0)
        device = "cpu" if backend == "gloo" else f"cuda:{torch.cuda.current_device()}"
        self.rlcore_group = WeightGroup(host, port, world_size, rank, backend, timeout_s, device)
        return rank

    def rlcore_receive_broadcast(self) -> int:
        """Receive one whole refit from the group and load it; returns bytes received."""
        group = getattr(self, "rlcore_group", None)
        if group is None:
            raise RuntimeError("this engine has not joined a weight broadcast group (rlcore_join_weight_group)")
        self.rlcore_begin_update()
        total = 0
        try:
            for chunk in group.receive():
                total += self.rlcore_load_tensors(chunk)
        finally:
            self.rlcore_finish_update()
        return total

