"""Schemas of this plugin's config sections. Imports none of the ecosystem packages (``rlcore plugins``
lists everything without them).

- ``env.code`` -> :class:`CodeEnvConfig`; ``data.name: code_tasks`` -> :class:`CodeTasksDatasetConfig`.
- ``env.reasoning_gym`` -> :class:`ReasoningGymEnvConfig`; ``data.name: reasoning_gym`` -> :class:`ReasoningGymDatasetConfig`.
- ``env.verifiers`` -> :class:`VerifiersEnvConfig`; ``data.name: verifiers`` -> :class:`VerifiersDatasetConfig`.
- ``env.openenv`` -> :class:`OpenEnvEnvConfig`; ``data.name: openenv`` -> :class:`OpenEnvDatasetConfig`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
from attrs import field, frozen

from rlcore.config.environment import MultiTurnEnvConfig
from rlcore.config.structure import ConfigError, doc

_positive = attrs.validators.gt(0)
_non_negative = attrs.validators.ge(0)

CODE_FAMILIES = ("arith", "strings", "lists", "counting")


@frozen(slots=False)  # no slots: combined with other bases below
class PromptKeys:
    """Keys every dataset of this plugin shares: sizes, seed and how prompts are rendered."""

    num_train: int = field(default=1000, validator=_positive, metadata=doc("training samples"))
    num_validation: int = field(default=64, validator=_non_negative, metadata=doc("held-out samples, disjoint from train"))
    seed: int = field(default=0, metadata=doc("generation seed"))
    system_prompt: str | None = field(default=None, metadata=doc("optional system message"))
    chat_template: bool = field(default=True, metadata=doc("apply the tokenizer's chat template (else encode the prompt text as is)"))
    max_prompt_tokens: int | None = field(default=None, metadata=doc("prompts longer than this are dropped and counted"))


# ---- code ------------------------------------------------------------------------------------
@frozen
class SandboxConfig:
    """Limits of one sandboxed solution run (bubblewrap + rlimits + a pids cgroup when root)."""

    bwrap: str = field(default="bwrap", metadata=doc("the bubblewrap binary (Debian: apt-get install bubblewrap)"))
    python: str | None = field(default=None, metadata=doc("interpreter run in the sandbox; None = this Python's base interpreter"))
    wall_time_s: float = field(default=10.0, validator=_positive, metadata=doc("wall-clock limit of one sample (sandbox start included)"))
    cpu_time_s: int = field(default=5, validator=_positive, metadata=doc("CPU-time limit (RLIMIT_CPU) of the solution's processes"))
    memory_mb: int = field(default=512, validator=_positive, metadata=doc("address-space limit (RLIMIT_AS) per process"))
    file_size_mb: int = field(default=4, validator=_positive, metadata=doc("largest file a solution may write (RLIMIT_FSIZE)"))
    tmp_size_mb: int = field(default=16, validator=_positive, metadata=doc("size of the one writable directory, /tmp (a tmpfs)"))
    max_processes: int = field(default=8, validator=_positive, metadata=doc("processes the solution may have at once, itself included"))
    max_open_files: int = field(default=64, validator=_positive, metadata=doc("open file descriptors (RLIMIT_NOFILE)"))
    max_output_bytes: int = field(default=1 << 20, validator=_positive, metadata=doc("stdout/stderr kept from a run; more is cut"))


@frozen
class CodeEnvConfig:
    """Write a Python function that passes hidden unit tests; graded in a bubblewrap sandbox pool."""

    sandbox: SandboxConfig = field(factory=SandboxConfig, metadata=doc("limits of each sandboxed run"))
    num_workers: int = field(default=2, validator=_positive, metadata=doc("sandboxes running at once"))
    per_test_timeout_s: float = field(default=1.0, validator=_positive, metadata=doc("time one hidden test may take inside the sandbox"))
    partial_credit: bool = field(default=False, metadata=doc("reward = fraction of tests passed (else 1 only when all pass)"))
    infra_retries: int = field(default=2, validator=_non_negative, metadata=doc("re-runs of a sample whose sandbox did not start"))
    max_solution_chars: int = field(default=20_000, validator=_positive, metadata=doc("longer solutions are rejected without running"))


@frozen(slots=False)
class CodeTasksDatasetConfig(PromptKeys):
    """Seeded, generated Python tasks: a function to write, hidden tests to pass."""

    name: Literal["code_tasks"] = field(default="code_tasks", metadata=doc("selects this dataset"))
    families: tuple[str, ...] = field(default=CODE_FAMILIES, metadata=doc(f"task families drawn from {list(CODE_FAMILIES)}"))
    tests_per_task: int = field(default=5, validator=_positive, metadata=doc("hidden tests per task"))
    prompt_template: str = field(
        default="Write a Python function {signature} that {description}. Answer with the code only.",
        metadata=doc("user message; '{signature}' and '{description}' are filled from the task"),
    )

    def __attrs_post_init__(self):
        bad = [f for f in self.families if f not in CODE_FAMILIES]
        if bad or not self.families:
            raise ConfigError("data.families", f"must be a non-empty list of {list(CODE_FAMILIES)}, got {list(self.families)}")


# ---- reasoning-gym ---------------------------------------------------------------------------
@frozen(slots=False)
class ReasoningGymDatasetConfig(PromptKeys):
    """reasoning-gym's procedural generators as a seeded dataset (a mix of tasks, one per sample)."""

    name: Literal["reasoning_gym"] = field(default="reasoning_gym", metadata=doc("selects this dataset"))
    tasks: tuple[str, ...] = field(default=("basic_arithmetic",), metadata=doc("reasoning-gym dataset names (reasoning_gym.factory)"))
    weights: tuple[float, ...] = field(default=(), metadata=doc("mixing weight of each task; empty = equal"))
    task_configs: dict[str, dict[str, Any]] = field(factory=dict, metadata=doc("keyword arguments of each task's config, by task name"))
    prompt_template: str = field(default="{question}", metadata=doc("user message; '{question}' is the generator's question"))

    def __attrs_post_init__(self):
        if not self.tasks:
            raise ConfigError("data.tasks", "name at least one reasoning-gym task")
        if self.weights and len(self.weights) != len(self.tasks):
            raise ConfigError("data.weights", f"{len(self.weights)} weights for {len(self.tasks)} tasks")
        if any(w < 0 for w in self.weights) or (self.weights and sum(self.weights) <= 0):
            raise ConfigError("data.weights", "weights must be >= 0 with a positive sum")
        extra = sorted(set(self.task_configs) - set(self.tasks))
        if extra:
            raise ConfigError(f"data.task_configs.{extra[0]}", f"not one of data.tasks {list(self.tasks)}")
        if "{question}" not in self.prompt_template:
            raise ConfigError("data.prompt_template", "must contain '{question}'")


@frozen
class ReasoningGymEnvConfig:
    """reasoning-gym's own scorer of each sample's task (``score_answer``) as the reward."""

    answer_from: Literal["last_line", "answer_tag", "whole"] = field(
        default="whole", metadata=doc("what of the response is the answer: all of it, its last line, or <answer>...</answer>"),
    )
    correct_threshold: float = field(default=1.0, metadata=doc("a score at least this counts as correct (accuracy)"))
    max_response_chars: int = field(default=20_000, validator=_positive, metadata=doc("longer responses score 0 without scoring"))


# ---- verifiers -------------------------------------------------------------------------------
@frozen(slots=False)
class VerifiersDatasetConfig(PromptKeys):
    """The tasks of an installed verifiers taskset (``verifiers.v1.load_taskset``) as samples."""

    name: Literal["verifiers"] = field(default="verifiers", metadata=doc("selects this dataset"))
    taskset: str = field(default="", metadata=doc("installed taskset package id (its module exports a vf.Taskset), or 'module:Class'"))
    taskset_args: dict[str, Any] = field(factory=dict, metadata=doc("more fields of the taskset's config"))

    def __attrs_post_init__(self):
        if not self.taskset:
            raise ConfigError("data.taskset", "name an installed verifiers taskset package")


@frozen(slots=False)
class VerifiersEnvConfig(MultiTurnEnvConfig):
    """A verifiers taskset's rewards (weighted), metrics and stop conditions; with ``env_class`` its
    ``vf.Env.run`` drives the conversation (the environment plays the user), turn by turn."""

    taskset: str = field(default="", metadata=doc("the same taskset package as data.taskset"))
    taskset_args: dict[str, Any] = field(factory=dict, metadata=doc("the same as data.taskset_args"))
    env_class: str | None = field(default=None, metadata=doc("'module:Class' of a vf.Env whose run() plays the user; None = single turn"))
    env_args: dict[str, Any] = field(factory=dict, metadata=doc("fields of that Env's config besides the taskset"))
    seat: str | None = field(default=None, metadata=doc("the Env's agent seat the policy plays; None = its only trainable seat"))
    turn_timeout_s: float = field(default=60.0, validator=_positive, metadata=doc("time the environment may take to answer a turn"))

    def __attrs_post_init__(self):
        if not self.taskset:
            raise ConfigError("env.verifiers.taskset", "name an installed verifiers taskset package")


# ---- OpenEnv ---------------------------------------------------------------------------------
@frozen(slots=False)
class OpenEnvServerKeys:
    """Where the OpenEnv environment server is: a URL, or a command this run starts and stops."""

    base_url: str | None = field(default=None, metadata=doc("a running server (http://host:port); None = start server_command"))
    server_command: tuple[str, ...] = field(
        default=(), metadata=doc("command that serves the environment; '{port}' is replaced by a free port, '{python}' by this interpreter"),
    )
    startup_timeout_s: float = field(default=60.0, validator=_positive, metadata=doc("time the started server may take to answer /health"))
    request_timeout_s: float = field(default=30.0, validator=_positive, metadata=doc("time one reset or step may take"))

    def _check(self, where: str) -> None:
        if bool(self.base_url) == bool(self.server_command):
            raise ConfigError(f"{where}.base_url", "give either base_url or server_command (exactly one)")


@frozen(slots=False)
class OpenEnvDatasetConfig(PromptKeys, OpenEnvServerKeys):
    """Episodes of an OpenEnv environment: each sample is one ``reset`` (its keyword arguments), its
    prompt the observation the reset returns."""

    name: Literal["openenv"] = field(default="openenv", metadata=doc("selects this dataset"))
    reset_args: dict[str, Any] = field(factory=dict, metadata=doc("keyword arguments of every reset"))
    seed_key: str | None = field(default="seed", metadata=doc("reset argument that gets each sample's seed; None = none"))
    prompt_template: str = field(default="{observation}", metadata=doc("user message; '{observation}' is the reset's observation"))
    observation_field: str | None = field(default=None, metadata=doc("observation field shown as the prompt; None = all of it as JSON"))

    def __attrs_post_init__(self):
        self._check("data")


@frozen(slots=False)
class OpenEnvEnvConfig(MultiTurnEnvConfig, OpenEnvServerKeys):
    """A client of an OpenEnv server: every trajectory resets its own session, each model turn is one
    ``step``; the rewards of the steps add up."""

    action_field: str = field(default="message", metadata=doc("field of the action the model's turn fills"))
    action_json: bool = field(default=False, metadata=doc("the model writes the whole action as JSON instead"))
    observation_field: str | None = field(default=None, metadata=doc("observation field shown to the model; None = all of it as JSON"))
    success_threshold: float = field(default=1.0, metadata=doc("a total reward at least this counts as correct (accuracy)"))

    def __attrs_post_init__(self):
        self._check("env.openenv")
