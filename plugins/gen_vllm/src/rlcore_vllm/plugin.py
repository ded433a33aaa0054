"""Registers the ``vllm`` generator and its weight transports. Imports no torch and no vLLM."""

from __future__ import annotations

from rlcore import hookimpl
from rlcore_vllm.config import VllmConfig


@hookimpl
def rlcore_generators(register):
    register(
        "vllm", "rlcore_vllm.generator:factory", VllmConfig,
        devices=("cpu", "cuda"), engines=("sync", "async"), placement=("colocated", "non_colocated"),
        parallelism=("tp", "dp"), multi_turn=True, requires=("vllm",),
    )


@hookimpl
def rlcore_weight_transport(trainer, generator):
    from rlcore_vllm.transport import pick_transport

    return pick_transport(trainer, generator)
