"""rlcore.training.compiling: compiled on request, eager after a compiler failure."""

from __future__ import annotations

import torch

from rlcore.training.compiling import CompiledOrEager


def test_compiled_then_eager_after_a_failure(caplog):
    calls = []

    def eager(x):
        calls.append("eager")
        return x * 2

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    kernels = CompiledOrEager("test kernels", {"double": (lambda x: x * 2, eager), "same": (eager, eager)},
                              backend=failing_backend)
    x = torch.arange(4.0)
    assert torch.equal(kernels.run("double", False, x), x * 2) and calls == ["eager"] and not kernels.failed
    assert torch.equal(kernels.run("double", True, x), x * 2)  # compile fails: eager result, logged
    assert kernels.failed and calls == ["eager", "eager"]
    assert "test kernels: compiling failed (" in caplog.text
    kernels.run("same", True, x)  # every function of the object runs eagerly from now on
    assert calls == ["eager"] * 3 and "same" not in kernels.compiled


def test_compiled_path_runs_compiled_code():
    kernels = CompiledOrEager("test kernels", {"add": (torch.add, torch.sub)}, backend="eager")
    a, b = torch.ones(3), torch.full((3,), 2.0)
    assert torch.equal(kernels.run("add", True, a, b), a + b)  # the function to compile, not the eager one
    assert not kernels.failed and "add" in kernels.compiled
