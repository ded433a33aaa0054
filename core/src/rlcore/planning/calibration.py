"""The planner's measured constants: efficiencies, per-step host costs, memory factors.

Three layers, later ones winning: the defaults below, the shipped ``data/calibration.json`` (fitted
to the project's measured GPU rows by :mod:`rlcore.planning.fit`), and the user's file written by
``rlcore plan --calibrate`` (``$RLCORE_CALIBRATION``, else ``~/.cache/rlcore/calibration.json``).
Each file maps a GPU name (``h200``, ``h100``) to some of :class:`Calibration`'s fields; a GPU with no entry
takes the shipped H200 values (efficiencies are fractions of the GPU's own peak).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import attrs
from attrs import field, frozen

from rlcore.config.structure import ConfigError, doc


@frozen
class Calibration:
    train_efficiency: float = field(default=0.5, metadata=doc("dense training: achieved / peak FLOP/s"))
    eager_efficiency: float = field(default=0.5, metadata=doc(
        "dense training on FSDP2 without torch.compile: achieved / peak FLOP/s (its norms, activations and loss run "
        "as separate eager kernels, which Megatron's fused layers and a compiled model do not)"))
    moe_efficiency: float = field(default=0.4, metadata=doc("mixture-of-experts training: achieved / peak FLOP/s"))
    fsdp2_moe_efficiency: float = field(default=0.25, metadata=doc("mixture-of-experts training on FSDP2 (experts one after another)"))
    forward_efficiency: float = field(default=0.5, metadata=doc("logprob passes (forward only): achieved / peak FLOP/s"))
    per_microbatch_s: float = field(default=0.01, metadata=doc("host time a micro-batch costs beyond its FLOPs"))
    activation_factor: float = field(default=1.0, metadata=doc("multiplies the activation bytes of the layer count (1: the tensors the layers keep)"))
    logits_bytes: float = field(default=4.0, metadata=doc("bytes per logit element while training (the bf16 logits the chunked logprob keeps and their bf16 gradient)"))
    forward_logits_bytes: float = field(default=6.0, metadata=doc("bytes per logit element in a logprob pass"))
    fixed_gib: float = field(default=1.0, metadata=doc("workspace, allocator slack and CUDA context on every GPU"))
    comm_buffer_gib: float = field(default=0.5, metadata=doc("collective buffers on a GPU with more than one rank"))
    comm_efficiency: float = field(default=0.7, metadata=doc("achieved / link bandwidth in collectives"))
    comm_overlap: float = field(default=0.6, metadata=doc("share of overlappable traffic (data-parallel, FSDP, CP) hidden behind compute"))
    decode_host_ms: float = field(default=7.0, metadata=doc("host time of one decode step of an engine"))
    decode_bandwidth_efficiency: float = field(default=0.8, metadata=doc("achieved / peak memory bandwidth reading weights and KV cache"))
    decode_flops_efficiency: float = field(default=0.5, metadata=doc("achieved / peak FLOP/s of a decode step's GEMMs"))
    prefill_efficiency: float = field(default=0.4, metadata=doc("achieved / peak FLOP/s of prefill"))
    engine_overhead_gib: float = field(default=4.0, metadata=doc("an awake engine's activations and CUDA graphs"))
    engine_asleep_gib: float = field(default=0.5, metadata=doc("what a sleeping engine keeps on the GPU"))
    refit_fixed_s: float = field(default=0.15, metadata=doc("fixed cost of one refit"))
    refit_gbps: float = field(default=13.0, metadata=doc("GB/s of weights into a colocated engine"))
    lora_merge_gbps: float = field(default=30.0, metadata=doc(
        "a LoRA run's refit: GB/s of merged weights the trainer makes (the adapters added into the base weights, cast "
        "to the engine's dtype) before it sends them"))
    wake_gibps: float = field(default=300.0, metadata=doc("GiB/s at which a colocated engine maps its KV cache back as it wakes (the refit phase's start)"))
    offload_gbps: float = field(default=50.0, metadata=doc("GB/s of trainer state to and from host memory"))
    headroom: float = field(default=0.05, metadata=doc("share of each GPU's memory a fitting layout leaves free (the model's error, fragmentation)"))
    source: str = field(default="defaults", metadata=doc("where these values came from"))


def user_calibration_path() -> Path:
    return Path(os.environ.get("RLCORE_CALIBRATION") or Path.home() / ".cache" / "rlcore" / "calibration.json")


def _entries(text: str, where: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("calibration", f"{where}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError("calibration", f"{where}: expected a mapping of GPU name to values")
    return data


def _apply(cal: Calibration, values: dict, where: str) -> Calibration:
    names = {f.name for f in attrs.fields(Calibration)} - {"source"}
    known = {k: float(v) for k, v in values.items() if k in names}
    unknown = sorted(set(values) - names - {"rows", "measured", "notes"})
    if unknown:
        raise ConfigError("calibration", f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(names))})")
    return attrs.evolve(cal, **known, source=where) if known else cal


def load_calibration(gpu: str, user_file: Path | None = None) -> Calibration:
    """The calibration for ``gpu``: defaults, then the shipped file, then the user's (if it exists)."""
    cal = Calibration()
    shipped = _entries(resources.files("rlcore.planning").joinpath("data/calibration.json").read_text(), "shipped calibration")
    base = shipped.get(gpu) or shipped.get("h200", {})
    cal = _apply(cal, base, f"shipped ({gpu if gpu in shipped else 'h200'} rows)")
    path = user_file or user_calibration_path()
    if path.is_file():
        user = _entries(path.read_text(), str(path))
        if gpu in user:
            cal = _apply(cal, user[gpu], str(path))
    return cal
