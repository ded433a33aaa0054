"""The ``code`` environment: the model writes a Python function, hidden unit tests grade it in a sandbox.

Single turn. The code is the last fenced block of the response (any language tag), or the whole
response when it has none. Each solution runs in its own bubblewrap sandbox
(:mod:`rlcore_envs.sandbox`), ``num_workers`` at a time, on the sample's hidden inputs; the host
compares the returned values with the reference outputs (JSON equality, so ``(1, 2)`` equals
``[1, 2]``). Reward: 1 when every test passes, else 0, or the fraction passed with
``partial_credit``.

Pure in the rlcore sense: model output never raises. A solution's failure is a wrong answer with its
reason counted in the metrics (``code/reason/<reason>``: ``failed_tests``, ``error``,
``wall_time_limit``, ``cpu_time_limit``, ``crashed``, ``killed``, ``file_size_limit``, ``exited``,
``rejected``) and logged at INFO with the first error. A sandbox that does not start is not the
solution's: it is retried ``infra_retries`` times, counted (``code/infra_retries``), and if it
still does not start the sample scores 0 with ``code/infra_failure`` and a warning. Building the
environment starts one sandbox, so a machine where bwrap cannot run fails before training, saying why.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re

from rlcore.interfaces import EnvStep, Sample

from rlcore_envs.config import CodeEnvConfig
from rlcore_envs.sandbox import SandboxResult, SandboxUnavailable, run_in_sandbox

log = logging.getLogger("rlcore_envs.code")
FENCE_RE = re.compile(r"```[^\n`]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_code(response: object) -> str | None:
    if not isinstance(response, str):
        return None
    blocks = FENCE_RE.findall(response)
    return blocks[-1] if blocks else response


def _same(value: object, expected: object) -> bool:
    return json.loads(json.dumps(expected)) == value


class CodeEnvironment:
    def __init__(self, config: CodeEnvConfig | None = None, check: bool = True):
        self.config = config or CodeEnvConfig()
        self.pool = concurrent.futures.ThreadPoolExecutor(self.config.num_workers, thread_name_prefix="rlcore-sandbox")
        if check:
            self.self_check()

    def self_check(self) -> None:
        """One trivial sandbox; raises :class:`SandboxUnavailable` with bwrap's own message if it cannot start."""
        result = run_in_sandbox(self.config.sandbox, "def f():\n    return 1\n", "f", [[]], self.config.per_test_timeout_s)
        if result.infra or result.tests != [{"value": 1}]:
            raise SandboxUnavailable(f"the code environment's sandbox does not work here: {result.reason}: {result.detail}")

    def run(self, code: str, answer: dict) -> SandboxResult:
        """One solution in the sandbox, retried while the sandbox itself fails to start."""
        for attempt in range(self.config.infra_retries + 1):
            result = run_in_sandbox(self.config.sandbox, code, answer["entry_point"], answer["inputs"], self.config.per_test_timeout_s)
            result.detail = f"{result.detail} (attempt {attempt + 1})" if result.infra else result.detail
            if not result.infra:
                result.attempts = attempt
                return result
        result.attempts = self.config.infra_retries
        return result

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        if len(samples) != len(histories):
            raise ValueError(f"step() got {len(samples)} samples but {len(histories)} histories")
        codes = [extract_code(h[-1] if isinstance(h, (list, tuple)) and h else "") for h in histories]
        futures = {}
        for i, (sample, code) in enumerate(zip(samples, codes)):
            if code is not None and len(code) <= self.config.max_solution_chars and code.strip():
                futures[i] = self.pool.submit(self.run, code, sample.answer)
        steps = []
        for i, sample in enumerate(samples):
            if i not in futures:
                steps.append(self._verdict(sample, None))
                continue
            steps.append(self._verdict(sample, futures[i].result()))
        return steps

    def _verdict(self, sample: Sample, result: SandboxResult | None) -> EnvStep:
        outputs = sample.answer["outputs"]
        if result is None:
            reason, passed, first_error = "rejected", 0, "empty, too long or not text"
        elif result.infra:
            log.warning("sample %s: the sandbox did not start after %d retries: %s", sample.index,
                        self.config.infra_retries, result.detail)
            return EnvStep(reward=0.0, done=True, metrics={"code/infra_failure": 1.0,
                                                            "code/infra_retries": float(self.config.infra_retries)})
        else:
            passed = sum(1 for test, want in zip(result.tests, outputs) if "value" in test and _same(test["value"], want))
            errors = [t["error"] for t in result.tests if "error" in t]
            first_error = result.error or (errors[0] if errors else result.detail or "wrong return values")
            reason = "passed" if result.reason == "ok" and passed == len(outputs) else \
                "failed_tests" if result.reason == "ok" else result.reason
        fraction = passed / len(outputs) if outputs else 0.0
        correct = passed == len(outputs) and bool(outputs)
        if not correct:
            log.info("sample %s (%s): %s: %s", sample.index, sample.metadata.get("task", "?"), reason, first_error)
        reward = fraction if self.config.partial_credit else float(correct)
        metrics = {"correct": float(correct), "code/pass_fraction": fraction, f"code/reason/{reason}": 1.0,
                   "code/infra_retries": float(result.attempts if result else 0)}
        return EnvStep(reward=reward, done=True, metrics=metrics)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def build_code_env(section_config: CodeEnvConfig | None) -> CodeEnvironment:
    return CodeEnvironment(section_config)
