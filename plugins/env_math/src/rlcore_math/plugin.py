"""Registers the ``math`` and ``math_tool`` environments and the ``math_jsonl`` and ``arithmetic`` datasets.

Factories are "module:attr" strings and the config classes import neither torch nor
math-verify, so ``rlcore plugins`` stays fast.
"""

from rlcore import hookimpl

from rlcore_math.config import ArithmeticDatasetConfig, MathEnvConfig, MathFilesDatasetConfig, MathToolEnvConfig


@hookimpl
def rlcore_environments(register):
    register("math", "rlcore_math.envs:build_math_env", MathEnvConfig, multi_turn=False, grader="math-verify",
             executors=("process", "ray", "inline"))
    register("math_tool", "rlcore_math.envs:build_math_tool_env", MathToolEnvConfig, multi_turn=True, grader="math-verify",
             tools=("calc",), executors=("process", "ray", "inline"))


@hookimpl
def rlcore_datasets(register):
    register("math_jsonl", "rlcore_math.files:build_math_files_dataset", MathFilesDatasetConfig,
             formats=("jsonl", "json", "parquet"), presets=("gsm8k", "math", "deepscaler", "custom"))
    register("arithmetic", "rlcore_math.arithmetic:build_arithmetic_dataset", ArithmeticDatasetConfig, synthetic=True)


@hookimpl
def rlcore_benchmarks():
    return {"grading": "rlcore_math.benchmark:grading"}
