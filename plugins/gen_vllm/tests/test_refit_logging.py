"""A refit logs nothing about layers that hold no weights.

vLLM's layer-wise reload counts every buffer as loadable, so a ``RotaryEmbedding`` (whose only
tensor is its ``cos_sin_cache``, derived from the config and in no checkpoint) waits for tensors
no refit can send and vLLM warns "RotaryEmbedding: Failed to load weights" after every refit.
:func:`rlcore_vllm.worker_ext.keep_derived_layers_out` keeps such layers out of the reload: the
warning is gone at its cause and the cache is the same tensor, unchanged. Built from vLLM's own
rotary layer and reload functions, without an engine.
"""

from __future__ import annotations

import logging

import pytest


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def reload_once(keep_out: bool) -> tuple[list[str], bool]:
    """One layer-wise reload of a module with a linear layer and vLLM's rotary embedding; returns
    vLLM's log messages and whether the rotary cache is the same, unchanged tensor afterwards."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload, initialize_layerwise_reload,
                                                         record_metadata_for_reloading)

    from rlcore_vllm.worker_ext import keep_derived_layers_out

    handler, vllm_logger = Records(), logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.WARNING)  # whatever the session's verbosity set
    try:
        with set_current_vllm_config(VllmConfig()):
            model = torch.nn.Module()
            model.proj = torch.nn.Linear(4, 4)
            model.rotary = get_rope(64, max_position=128, is_neox_style=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
            cache = model.rotary.cos_sin_cache
            before = cache.clone()
            record_metadata_for_reloading(model)
            initialize_layerwise_reload(model)
            if keep_out:
                assert keep_derived_layers_out(model) == ["RotaryEmbedding"]
            model.proj.weight.weight_loader(model.proj.weight, torch.full((4, 4), 2.0))
            model.proj.bias.weight_loader(model.proj.bias, torch.ones(4))
            finalize_layerwise_reload(model, None)
            assert torch.equal(model.proj.weight, torch.full((4, 4), 2.0))  # the weights were reloaded
            same = model.rotary.cos_sin_cache is cache and torch.equal(cache, before)
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)
    return handler.messages, same


def test_rotary_caches_stay_out_of_the_reload():
    pytest.importorskip("vllm")
    messages, same = reload_once(keep_out=False)
    assert "RotaryEmbedding: Failed to load weights" in messages  # vLLM's false alarm, without the fix
    messages, same = reload_once(keep_out=True)
    assert not [m for m in messages if "Failed to load" in m], messages
    assert same
