"""How much the libraries underneath a run print (``logger.verbosity``, ``--verbose``).

rlcore's own lines (the run id, the per-step table, the summary, where the outputs went) are
the console of a run. vLLM, transformers, Ray and torch.distributed log at INFO by default and
draw progress bars on every model load: a 5-step CPU run printed 72 such lines beside 23 of
rlcore's. ``quiet`` (the default) keeps their errors only; ``verbose`` leaves them at their own
defaults. Each library is set through its own documented switch (an environment variable read
when it is first imported, or its logging API), and a value the user exported is kept, so
``VLLM_LOGGING_LEVEL=DEBUG rlcore run ...`` still works; child processes (vLLM's engine core,
Ray workers) inherit the environment.
"""

from __future__ import annotations

import logging
import os
import sys

# Library switches read from the environment (each when the library is first imported).
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vllm.envs: level of the "vllm" logger, in the engine processes too
    "TRANSFORMERS_VERBOSITY": "error",  # transformers.utils.logging
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub's and transformers' tqdm bars ("Loading weights")
    "TOKENIZERS_PARALLELISM": "false",  # the fork warning of tokenizers
    "RAY_DEDUP_LOGS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10d's C++ warnings
}
# At every verbosity: logs are not a command's output, so they go to stderr (vLLM's default is stdout).
LOGS_TO_STDERR = {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}
# Python loggers of libraries already imported when the run starts (the env above comes too late for them).
QUIET_LOGGERS = ("vllm", "transformers", "ray", "torch.distributed", "torch._dynamo", "torch._inductor", "urllib3", "filelock")
_applied: str | None = None


def apply_verbosity(verbosity: str = "quiet") -> None:
    """Set the libraries' logging for ``verbosity`` (``quiet`` or ``verbose``) in this process and
    in the processes it starts. Idempotent; called by ``rlcore.run``, ``rlcore eval`` and the CLI
    before anything heavy is imported."""
    global _applied
    if verbosity not in ("quiet", "verbose"):
        raise ValueError(f"logger.verbosity must be 'quiet' or 'verbose', got {verbosity!r}")
    if _applied == verbosity:
        return
    _applied = verbosity
    for key, value in LOGS_TO_STDERR.items():
        os.environ.setdefault(key, value)
    if verbosity == "verbose":
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
        if "transformers" in sys.modules:
            _transformers(verbose=True)
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if "transformers" in sys.modules:  # imported before: its env switches were read already
        _transformers(verbose=False)


def _transformers(verbose: bool) -> None:
    from transformers.utils import logging as hf_logging

    if verbose:
        hf_logging.set_verbosity_info()
        hf_logging.enable_progress_bar()
    else:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
