"""``torch.compile`` with an eager fallback, for small hot functions of the backends.

Compilers fail in many ways (a missing toolchain, an unsupported op in one torch version); the
eager function computes the same values, so a failure is logged once and the run goes on
eagerly. Used by :mod:`rlcore.training.ops` (logprob chunk kernels) and by plugins (rlcore-fsdp2's
one-rank gradient accumulation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class CompiledOrEager:
    """Named functions compiled by ``torch.compile`` on their first compiled call.

    ``functions``: name -> (function to compile, its eager equivalent). When compiling or running
    any of them fails, the failure is logged and from then on all of them run eagerly (``failed``).
    ``compile_kwargs`` go to ``torch.compile``."""

    def __init__(self, what: str, functions: dict[str, tuple[Callable, Callable]], **compile_kwargs: Any):
        self.what, self.functions, self.compile_kwargs = what, functions, compile_kwargs
        self.compiled: dict[str, Callable] = {}
        self.failed = False

    def run(self, name: str, compiled: bool, *args: Any) -> Any:
        """``functions[name]`` on ``args``: compiled if ``compiled`` and nothing failed yet, else eager."""
        to_compile, eager = self.functions[name]
        if not compiled or self.failed:
            return eager(*args)
        if name not in self.compiled:
            self.compiled[name] = torch.compile(to_compile, **self.compile_kwargs)
        try:
            return self.compiled[name](*args)
        except Exception as e:  # noqa: BLE001 - compilers fail in many ways; eager is always correct
            self.failed = True
            log.warning("%s: compiling failed (%s: %s); running eagerly", self.what, type(e).__name__, e)
            return eager(*args)
