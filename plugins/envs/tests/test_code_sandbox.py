"""The code environment's sandbox against hostile solutions: each is contained and scored as a failure
with its reason counted and logged. Needs bwrap (Debian: apt-get install bubblewrap)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from rlcore.interfaces import Sample
from rlcore.testing.conformance import EnvironmentConformance

from rlcore_envs.code_env import CodeEnvironment, extract_code
from rlcore_envs.config import CodeEnvConfig, SandboxConfig
from rlcore_envs.sandbox import bwrap_command, run_in_sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (apt-get install bubblewrap)")
PROJECT_FILE = Path(__file__).resolve()
LIMITS = SandboxConfig(wall_time_s=8.0, cpu_time_s=2, memory_mb=256, max_processes=4)


@pytest.fixture(scope="module")
def env():
    environment = CodeEnvironment(CodeEnvConfig(sandbox=LIMITS, per_test_timeout_s=1.0, infra_retries=1))
    yield environment
    environment.close()


def double_sample() -> Sample:
    return Sample(prompt="Write f(x) returning 2x.", answer={"entry_point": "f", "inputs": [[1], [5]], "outputs": [2, 10]},
                  metadata={"task": "arith"}, index=0)


def grade(env, code: str, caplog):
    with caplog.at_level(logging.INFO, logger="rlcore_envs.code"):
        (step,) = env.step([double_sample()], [[f"```python\n{code}\n```"]])
    return step, caplog.text


def reason_of(step) -> str:
    (reason,) = [k.removeprefix("code/reason/") for k in step.metrics if k.startswith("code/reason/")]
    return reason


def test_a_right_solution_passes(env):
    (step,) = env.step([double_sample()], [["def f(x):\n    return 2 * x\n"]])
    assert step.reward == 1.0 and step.metrics["correct"] == 1.0 and reason_of(step) == "passed"


def test_partial_credit_counts_tests():
    env = CodeEnvironment(CodeEnvConfig(sandbox=LIMITS, partial_credit=True), check=False)
    (step,) = env.step([double_sample()], [["def f(x):\n    return 2 if x == 1 else 0\n"]])
    assert step.reward == 0.5 and step.metrics["correct"] == 0.0 and reason_of(step) == "failed_tests"


HOSTILE = {
    # name: (solution, reason counted, text the log must hold)
    "fork_bomb": ("import os\ndef f(x):\n    while True:\n        os.fork()\n", "failed_tests", "Resource temporarily unavailable"),
    # 1 GiB blocks (bytearray fills each one): RLIMIT_AS refuses the first, before any page is touched, so
    # the outcome does not depend on how fast a loaded machine fills memory against the per-test limit
    "memory_bomb": ("def f(x):\n    blocks = []\n    while True:\n        blocks.append(bytearray(1 << 30))\n",
                    "failed_tests", "MemoryError"),
    "infinite_loop_at_import": ("while True:\n    pass\n", None, None),
    "write_outside_tmp": ("def f(x):\n    open('/usr/pwned', 'w').write('x')\n    return 2 * x\n", "failed_tests",
                          "Read-only file system"),
    "read_etc_passwd": ("def f(x):\n    return open('/etc/passwd').read()\n", "failed_tests", "No such file or directory"),
    "read_project_file": (f"def f(x):\n    return open({str(PROJECT_FILE)!r}).read()\n", "failed_tests", "No such file or directory"),
    "open_socket": ("import socket\ndef f(x):\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    return 2 * x\n",
                    "failed_tests", "Network is unreachable"),
    "os_system": ("import os\ndef f(x):\n    return os.system('echo pwned > /tmp/x')\n", "failed_tests", "failed_tests"),
    "ctypes_crash": ("import ctypes\nctypes.string_at(0)\n", "crashed", "SIGSEGV"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_solution_is_contained_and_fails(env, name, caplog):
    code, reason, logged = HOSTILE[name]
    step, log_text = grade(env, code, caplog)
    assert step.reward == 0.0 and step.metrics["correct"] == 0.0
    assert "code/infra_failure" not in step.metrics  # the solution's failure, not the sandbox's
    if reason is None:  # a loop at import: the CPU or the wall-clock limit ends it, whichever comes first
        assert reason_of(step) in ("cpu_time_limit", "wall_time_limit")
    else:
        assert reason_of(step) == reason
    assert f"sample 0 (arith): {reason_of(step)}" in log_text
    if logged:
        assert logged in log_text


def test_infinite_loop_inside_a_test_hits_the_per_test_limit(caplog):
    # Two hidden tests of 0.5 s each spend 1 s of CPU, well under the 2 s CPU limit: the per-test
    # alarm, not RLIMIT_CPU, must be what ends each one (at 1 s a test the two limits would race).
    environment = CodeEnvironment(CodeEnvConfig(sandbox=LIMITS, per_test_timeout_s=0.5, infra_retries=1))
    try:
        step, log_text = grade(environment, "def f(x):\n    while True:\n        pass\n", caplog)
    finally:
        environment.close()
    assert step.reward == 0.0 and reason_of(step) == "failed_tests" and "time limit" in log_text


def test_the_sandbox_sees_only_the_interpreter_and_tmp():
    code = "import os\ndef f():\n    return sorted(os.listdir('/'))\n"
    result = run_in_sandbox(LIMITS, code, "f", [[]], 1.0)
    assert result.reason == "ok"
    # "/" holds /dev, /tmp and the top directories of what the sandbox binds read-only: the interpreter's
    # installation and the libraries it links, wherever this machine keeps them
    command = bwrap_command(LIMITS)
    bound = {command[i + 1] for i, arg in enumerate(command) if arg == "--ro-bind"}
    assert set(result.tests[0]["value"]) <= {"dev", "tmp"} | {Path(path).parts[1] for path in bound}
    # the project's files are not there, wherever the checkout lives (a checkout under /tmp meets the sandbox's own /tmp)
    seen = f"import os\ndef f():\n    return os.path.exists({str(PROJECT_FILE)!r})\n"
    assert run_in_sandbox(LIMITS, seen, "f", [[]], 1.0).tests == [{"value": False}]
    # the interpreter's own site-packages (torch, rlcore, ...) is hidden under an empty tmpfs
    site = "import os, sys, sysconfig\ndef f():\n    return os.listdir(sysconfig.get_paths()['purelib'])\n"
    assert run_in_sandbox(LIMITS, site, "f", [[]], 1.0).tests == [{"value": []}]


def test_a_sandbox_that_cannot_start_is_an_infrastructure_failure(caplog):
    broken = CodeEnvConfig(sandbox=SandboxConfig(bwrap="/nonexistent/bwrap"), infra_retries=2)
    env = CodeEnvironment(broken, check=False)
    with caplog.at_level(logging.WARNING, logger="rlcore_envs.code"):
        (step,) = env.step([double_sample()], [["def f(x):\n    return 2 * x\n"]])
    assert step.reward == 0.0 and step.metrics["code/infra_failure"] == 1.0 and "correct" not in step.metrics
    assert step.metrics["code/infra_retries"] == 2.0 and "did not start after 2 retries" in caplog.text


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("a\n```python\nx = 1\n```\nthen\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code(None) is None


class TestCodeConformance(EnvironmentConformance):
    @pytest.fixture(scope="class")
    def environment(self):
        environment = CodeEnvironment(CodeEnvConfig(sandbox=LIMITS))
        yield environment
        environment.close()

    @pytest.fixture
    def env_samples(self):
        from rlcore_envs.code_tasks import generate
        from rlcore_envs.config import CodeTasksDatasetConfig

        train, _ = generate(CodeTasksDatasetConfig(num_train=3, num_validation=0, seed=2))
        return train

    @pytest.fixture
    def env_graded_examples(self):
        sample = double_sample()
        return [(sample, ["def f(x):\n    return x + x\n"], 1.0), (sample, ["def f(x):\n    return x\n"], 0.0),
                (sample, ["I do not know", "```python\ndef f(x):\n    return 2 * x\n```"], 1.0)]
