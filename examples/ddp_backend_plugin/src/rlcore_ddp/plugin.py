"""Registers the ``ddp`` training backend with rlcore (entry point group ``rlcore``).

The factory is a "module:attr" string, resolved only when a run builds the backend, so that
``rlcore plugins`` lists it without importing torch.
"""

from rlcore import hookimpl

from rlcore_ddp.config import SECTION, DDPConfig


@hookimpl
def rlcore_training_backends(register):
    register(
        "ddp",
        "rlcore_ddp.backend:build_backend",
        DDPConfig,
        section=SECTION,
        precedence=5,  # wins over fsdp2 (0), which recipes enable by default; megatron (10) wins over it
        devices=("cpu", "cuda"),
        parallelism=("dp",),
        packing=True,
        requires=("torch", "transformers"),
    )
