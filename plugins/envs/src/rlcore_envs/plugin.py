"""Registers the ``code``, ``reasoning_gym``, ``verifiers`` and ``openenv`` environments and their datasets.

Factories are "module:attr" strings and the config classes import none of the ecosystem packages, so
``rlcore plugins`` lists every adapter whether or not its extra is installed; building one whose
package is missing fails naming the extra (``pip install 'rlcore-envs[verifiers]'``).

``conformance="plugin"``: these environments grade their own datasets' structured samples (hidden
tests, a generator's entry, a taskset's task, a server's episode), not text answers, so rlcore's
suite of every registered environment leaves them to this plugin's tests, which run
:class:`rlcore.testing.conformance.EnvironmentConformance` with such samples.
"""

from rlcore import hookimpl

from rlcore_envs.config import (
    CodeEnvConfig, CodeTasksDatasetConfig, OpenEnvDatasetConfig, OpenEnvEnvConfig, ReasoningGymDatasetConfig,
    ReasoningGymEnvConfig, VerifiersDatasetConfig, VerifiersEnvConfig,
)


@hookimpl
def rlcore_environments(register):
    register("code", "rlcore_envs.code_env:build_code_env", CodeEnvConfig, multi_turn=False, sandbox="bubblewrap",
             extra="code", conformance="plugin")
    register("reasoning_gym", "rlcore_envs.reasoning_gym_env:build_env", ReasoningGymEnvConfig, multi_turn=False,
             extra="reasoning-gym", conformance="plugin")
    register("verifiers", "rlcore_envs.verifiers_env:build_env", VerifiersEnvConfig, multi_turn=True, extra="verifiers",
             conformance="plugin")
    register("openenv", "rlcore_envs.openenv_env:build_env", OpenEnvEnvConfig, multi_turn=True, transport="http",
             extra="openenv", conformance="plugin")


@hookimpl
def rlcore_datasets(register):
    register("code_tasks", "rlcore_envs.code_tasks:build_dataset", CodeTasksDatasetConfig, synthetic=True)
    register("reasoning_gym", "rlcore_envs.reasoning_gym_env:build_dataset", ReasoningGymDatasetConfig, synthetic=True)
    register("verifiers", "rlcore_envs.verifiers_env:build_dataset", VerifiersDatasetConfig)
    register("openenv", "rlcore_envs.openenv_env:build_dataset", OpenEnvDatasetConfig)
