"""Registers the ``sglang`` generator and its weight transport. Imports no torch and no SGLang."""

from __future__ import annotations

from rlcore import hookimpl
from rlcore_sglang.config import SglangConfig


@hookimpl
def rlcore_generators(register):
    register(
        "sglang", "rlcore_sglang.generator:factory", SglangConfig,
        devices=("cuda",), engines=("sync", "async"), placement=("colocated", "non_colocated"),
        parallelism=("tp",), multi_turn=True, requires=("sglang",),
    )


@hookimpl
def rlcore_weight_transport(trainer, generator):
    from rlcore_sglang.transport import pick_transport

    return pick_transport(trainer, generator)
