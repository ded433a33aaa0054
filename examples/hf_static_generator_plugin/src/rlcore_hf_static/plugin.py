"""Registers the ``hf_static`` generator and its refit transport with rlcore (entry point group ``rlcore``).

Factories are "module:attr" strings or import inside the hook, so ``rlcore plugins`` lists this
plugin without importing torch or transformers.
"""

from rlcore import hookimpl

from rlcore_hf_static.config import HFStaticGenerationConfig


@hookimpl
def rlcore_generators(register):
    register("hf_static", "rlcore_hf_static.generator:build", HFStaticGenerationConfig,
             devices=("cpu", "cuda"), async_engine=False, requires=("torch", "transformers"))


@hookimpl
def rlcore_weight_transport(trainer, generator):
    from rlcore_hf_static.transport import pick_transport

    return pick_transport(trainer, generator)
