"""Registers the ``toy_echo`` environment with rlcore (entry point group ``rlcore``).

The factory is a "module:attr" string, resolved only when a run builds the environment, so that
``rlcore plugins`` lists it without importing more than the config schema.
"""

from rlcore import hookimpl

from rlcore_toy_env.config import ToyEchoConfig


@hookimpl
def rlcore_environments(register):
    register("toy_echo", "rlcore_toy_env.env:build", ToyEchoConfig, multi_turn=False, devices=("cpu",))
