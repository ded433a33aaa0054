"""LoRA adapters on the Megatron backend (``policy.lora``: the keys the fsdp2 backend reads).

Adapters are attached from outside the model, to the tensor-parallel linear layers Megatron built
(``ColumnParallelLinear``/``RowParallelLinear``, or Transformer Engine's): each adapted layer gets a
``lora`` child holding the adapter weights and a forward hook that adds ``(alpha / r) * B A x`` to
its output, so the base layer's parameter names, loading and export stay as they are. Every base
parameter is frozen: Megatron's DDP builds gradient buffers, and its optimizer main copies and
state, only for parameters that require gradients, so the frozen base stays in the training dtype
with no fp32 copy and no optimizer state. The reference policy is the base: the hooks switched off.

Targets are the Hugging Face names the fsdp2 backend (PEFT) accepts. Megatron fuses some of them
into one layer: ``q_proj``/``k_proj``/``v_proj`` are ``linear_qkv`` and ``gate_proj``/``up_proj`` are
``linear_fc1``. A fused layer carries one adapter per Hugging Face projection it holds (its own A
and B, as PEFT has them), whose outputs are laid out as the fused weight's rows are, and zeros for
projections not targeted; so any subset of names trains exactly the model PEFT would, and the
adapter exports to PEFT unchanged. The Megatron names (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``) are accepted too, each meaning all of its projections.

Sharding follows the base layer. Column-parallel (``linear_qkv``, ``linear_fc1``): A is replicated
and B split on the output rows as the base weight's are; the rank-r activations ``A x`` get their
gradient all-reduced over the tensor-parallel group (``copy_to_tensor_model_parallel_region``), so
A's gradient is whole and the same on every rank. Row-parallel (``linear_proj``, ``linear_fc2``): A
is split on the input columns and ``A x`` all-reduced over the group; B is replicated and sees the
whole rank-r activations, so its gradient is whole on every rank too. With sequence parallelism the
column adapter all-gathers the sequence (its backward keeps the rank's slice) and the row adapter
scatters its output back to the rank's slice. No gradient needs a reduction after the backward.
Dropout, when set, applies to the adapter's input, once per projection, as PEFT's does.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from rlcore.config import ConfigError
from rlcore.training.lora import peft_name
from rlcore_megatron.convert import LAYER, Shape, _gather, _layer_numbers, iter_hf_weights

KEY = "policy.lora.target_modules"
# Megatron layer (relative to a decoder layer) -> (Hugging Face module prefix, projections in the layer's row order).
LAYERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("self_attn", ("o_proj",)),
    "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("mlp", ("down_proj",)),
}
ROW_PARALLEL = {"self_attention.linear_proj", "mlp.linear_fc2"}


def targets(names) -> dict[str, tuple[str, ...]]:
    """Megatron layer -> the Hugging Face projections of it that ``policy.lora.target_modules`` adapts."""
    by_name = {proj: layer for layer, (_, projs) in LAYERS.items() for proj in projs}
    by_name.update({layer.rsplit(".", 1)[1]: layer for layer in LAYERS})
    chosen: dict[str, set[str]] = {}
    for name in names:
        if name not in by_name:
            raise ConfigError(KEY, f"{name!r} is not a layer the megatron backend adapts; valid: {', '.join(by_name)}")
        layer = by_name[name]
        projections = LAYERS[layer][1]
        chosen.setdefault(layer, set()).update({name} if name in projections else projections)  # a Megatron name: all
    if not chosen:
        raise ConfigError(KEY, "is empty: name at least one layer to adapt")
    return {layer: tuple(p for p in LAYERS[layer][1] if p in projs) for layer, projs in chosen.items()}


class LoraAdapter(torch.nn.Module):
    """One layer's adapters: ``A[proj]`` [r, in] and ``B[proj]`` [out, r] per adapted projection, this rank's shards."""

    def __init__(self, layer: str, projections: tuple[str, ...], out_local: dict[str, int], in_full: int, cfg,
                 shape: Shape, dtype: torch.dtype, device):
        super().__init__()
        self.layer, self.row_parallel = layer, layer in ROW_PARALLEL
        self.projections, self.out_local, self.shape = projections, out_local, shape
        self.scale, self.dropout, self.enabled, self.sequence_parallel = cfg.alpha / cfg.rank, cfg.dropout, True, False
        tp = mpu.get_tensor_model_parallel_world_size()
        in_local = in_full // tp if self.row_parallel else in_full
        self.A = torch.nn.ParameterDict({p: torch.nn.Parameter(torch.empty(cfg.rank, in_local, dtype=dtype, device=device))
                                         for p in projections})
        self.B = torch.nn.ParameterDict({p: torch.nn.Parameter(torch.zeros(out_local[p], cfg.rank, dtype=dtype, device=device))
                                         for p in projections})
        for p in projections:  # sharded halves: counted once in the gradient norm, saved as shards
            if self.row_parallel:
                set_tensor_model_parallel_attributes(self.A[p], True, 1, 1)
            else:
                set_tensor_model_parallel_attributes(self.B[p], True, 0, 1)

    @torch.no_grad()
    def initialize(self, seed: int, global_layer: int) -> None:
        """PEFT's initialisation (A Kaiming-uniform on the whole matrix, B zero), drawn from a generator seeded by the
        layer and projection, so every parallel layout starts from the same adapters."""
        for index, proj in enumerate(self.projections):
            a = self.A[proj]
            generator = torch.Generator().manual_seed(seed * 1_000_003 + global_layer * 16 + index)
            full = torch.empty(a.shape[0], self.full_in(a), dtype=torch.float32)
            bound = 1.0 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
            full.uniform_(-bound, bound, generator=generator)
            a.copy_(self.local_a(full))
            self.B[proj].zero_()

    def full_in(self, a: torch.Tensor) -> int:
        return a.shape[1] * (mpu.get_tensor_model_parallel_world_size() if self.row_parallel else 1)

    def local_a(self, full: torch.Tensor) -> torch.Tensor:
        if not self.row_parallel:
            return full
        return torch.chunk(full, mpu.get_tensor_model_parallel_world_size(), dim=1)[mpu.get_tensor_model_parallel_rank()]

    def local_b(self, full: torch.Tensor) -> torch.Tensor:
        if self.row_parallel:
            return full
        return torch.chunk(full, mpu.get_tensor_model_parallel_world_size(), dim=0)[mpu.get_tensor_model_parallel_rank()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.row_parallel and self.sequence_parallel:  # the rank's slice of the sequence -> all of it
            x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        # ParameterDict sorts its keys: the projections' own order is self.projections
        h = torch.cat([F.linear(self._drop(x), self.A[p]) for p in self.projections], dim=-1)
        if self.row_parallel:
            h = tensor_parallel.reduce_from_tensor_model_parallel_region(h)
        else:
            h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
        outs = dict(zip(self.projections, (F.linear(h_p, self.B[p]) for p, h_p in zip(self.projections, h.chunk(len(self.A), -1)))))
        y = self._layout(outs, x) * self.scale
        if self.row_parallel and self.sequence_parallel:
            y = tensor_parallel.scatter_to_sequence_parallel_region(y)
        return y

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.dropout or not self.training:
            return x
        if self.row_parallel:  # each rank drops from its own slice of the hidden dimension, as Megatron's sharded dropout
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.dropout(x, self.dropout)
        return F.dropout(x, self.dropout)

    def _layout(self, outs: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The projections' outputs in the fused layer's row order (zeros for projections not adapted)."""
        lead = next(iter(outs.values())).shape[:-1]
        full = [outs.get(p, x.new_zeros(*lead, n)) for p, n in self.out_local.items()]
        if self.layer != "self_attention.linear_qkv":
            return torch.cat(full, dim=-1) if len(full) > 1 else full[0]
        groups = self.shape.num_groups // mpu.get_tensor_model_parallel_world_size()
        q, k, v = (t.reshape(*lead, groups, -1) for t in full)  # per key/value group: [its q heads, k, v]
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)


def _out_local(layer: str, hf_config, shape: Shape) -> dict[str, int]:
    """Rows of each projection of ``layer`` on this tensor-parallel rank."""
    tp = mpu.get_tensor_model_parallel_world_size()
    if layer == "self_attention.linear_qkv":
        return {"q_proj": shape.num_heads * shape.head_dim // tp, "k_proj": shape.num_groups * shape.head_dim // tp,
                "v_proj": shape.num_groups * shape.head_dim // tp}
    if layer == "mlp.linear_fc1":
        return {"gate_proj": hf_config.intermediate_size // tp, "up_proj": hf_config.intermediate_size // tp}
    if layer == "self_attention.linear_proj":
        return {"o_proj": hf_config.hidden_size}
    return {"down_proj": hf_config.hidden_size}


def _in_full(layer: str, hf_config, shape: Shape) -> int:
    return {"self_attention.linear_proj": shape.num_heads * shape.head_dim,
            "mlp.linear_fc2": hf_config.intermediate_size}.get(layer, hf_config.hidden_size)


def _adapter_input(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the base layer multiplies: Transformer Engine's fused norm + linear layers take the
    un-normalized input and normalize it themselves (RMSNorm: every model this backend builds)."""
    norm_weight = getattr(module, "layer_norm_weight", None)
    if norm_weight is None:
        return x
    weight = norm_weight + 1 if getattr(module, "zero_centered_gamma", False) else norm_weight
    return F.rms_norm(x, (x.shape[-1],), weight, getattr(module, "eps", 1e-5))


def _hook(module, args, kwargs, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(_adapter_input(module, x)).to(out.dtype), bias


def kernels_for_lora(kernels, cfg):
    """``kernels`` without Transformer Engine's op fuser, which runs the MLP's linear layers as one fused op, past
    their forward (and so past an adapter's hook); asked for explicitly, it is an error naming the key."""
    if not kernels.te_op_fuser:
        return kernels
    if cfg.use_te_op_fuser:
        raise ConfigError("policy.megatron_cfg.use_te_op_fuser", "runs the MLP's linear layers past their LoRA adapters; "
                          "leave it unset (or false) with policy.lora.enabled")
    import attrs

    return attrs.evolve(kernels, te_op_fuser=False)


def apply(model, cfg, hf_config, seed: int) -> list[LoraAdapter]:
    """Attach adapters to ``model`` (this rank's shard, weights loaded), freeze everything else; returns the adapters."""
    if int(getattr(hf_config, "num_experts", 0) or 0):
        raise ConfigError("policy.lora.enabled", "LoRA on the megatron backend covers dense models; this one has "
                          "experts (use the fsdp2 backend, or train it without LoRA)")
    chosen, shape = targets(cfg.target_modules), Shape.from_hf(hf_config)
    for param in model.parameters():
        param.requires_grad_(False)
    layer_number, adapters = _layer_numbers(model), []
    for index, layer in enumerate(model.decoder.layers):
        if hasattr(layer.mlp, "_make_fused_impl"):  # TE's fused MLP: its forward skips linear_fc1/linear_fc2's own
            raise ConfigError("policy.megatron_cfg.use_te_op_fuser", "fuses the MLP past its LoRA adapters; set it to false")
        for name, projections in chosen.items():
            base = getattr(layer.get_submodule(name.split(".")[0]), name.split(".")[1], None)
            if not isinstance(getattr(base, "weight", None), torch.Tensor):
                raise ConfigError(KEY, f"{name} of this model is {type(base).__name__}, not a linear layer an adapter can wrap")
            adapter = LoraAdapter(name, projections, _out_local(name, hf_config, shape), _in_full(name, hf_config, shape),
                                  cfg, shape, base.weight.dtype, base.weight.device)
            adapter.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
            adapter.initialize(seed, layer_number(index))
            base.lora = adapter
            base.register_forward_hook(_hook, with_kwargs=True)
            adapters.append(adapter)
    return adapters


@contextlib.contextmanager
def disabled(adapters: list[LoraAdapter]):
    """The base model: every adapter off (the reference policy)."""
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def _named(model) -> Iterator[tuple[str, LoraAdapter]]:
    """(Hugging Face module prefix ``model.layers.<global>.<self_attn|mlp>``, adapter) for this stage's adapters."""
    layer_number = _layer_numbers(model)
    for index, layer in enumerate(model.decoder.layers):
        for name, (hf_module, _) in LAYERS.items():
            adapter = getattr(layer.get_submodule(name), "lora", None)
            if adapter is not None:
                yield f"model.layers.{layer_number(index)}.{hf_module}", adapter


def adapter_tensors(model, hf_config, of: Callable[[torch.Tensor], torch.Tensor] = lambda p: p.detach()) -> dict[str, torch.Tensor]:
    """Whole ``of(param)`` of every adapter under PEFT's saved names, on global rank 0 (empty elsewhere); every rank
    calls it (collectives). ``of``: what to read (the parameter; ``lambda p: p.main_grad`` for its gradient)."""
    return {name: t.clone() for name, t in iter_hf_weights(model, hf_config, stage=lambda: _stage_adapter_tensors(model, of))}


def _stage_adapter_tensors(model, of: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's adapters, gathered over the tensor-parallel group."""
    group = mpu.get_tensor_model_parallel_group()
    for prefix, adapter in _named(model):
        for proj in adapter.projections:
            a, b = of(adapter.A[proj]), of(adapter.B[proj])
            a = _gather(a, group, 1) if adapter.row_parallel else a
            b = b if adapter.row_parallel else _gather(b, group, 0)
            yield peft_name(f"{prefix}.{proj}", "lora_A"), a
            yield peft_name(f"{prefix}.{proj}", "lora_B"), b


@torch.no_grad()
def load_adapter_tensors(model, tensors: dict[str, torch.Tensor]) -> None:
    """Set this rank's adapter shards from whole tensors under PEFT's saved names (strict: every adapter is set)."""
    for prefix, adapter in _named(model):
        for proj in adapter.projections:
            adapter.A[proj].copy_(adapter.local_a(tensors[peft_name(f"{prefix}.{proj}", "lora_A")]))
            adapter.B[proj].copy_(adapter.local_b(tensors[peft_name(f"{prefix}.{proj}", "lora_B")]))


def hf_targets(adapters: list[LoraAdapter]) -> list[str]:
    """The Hugging Face module names adapted (PEFT's ``target_modules``)."""
    return sorted({p for adapter in adapters for p in adapter.projections})


def merged(named: Iterator[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor], scale: float,
           dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face weights with each adapted one merged (:func:`rlcore.training.lora.merge`, float32, cast once to ``dtype``,
    default the weight's); ``adapters``: whole tensors under PEFT's saved names."""
    from rlcore.training.lora import merge

    for name, weight in named:
        module = name.removesuffix(".weight")
        a = adapters.get(peft_name(module, "lora_A"))
        if a is None:
            yield name, weight if dtype is None else weight.to(dtype)
        else:
            yield name, merge(weight, a, adapters[peft_name(module, "lora_B")], scale, dtype or weight.dtype)


def sharded_state_dict(model) -> dict:
    """The adapters alone as ``dist_checkpointing`` sharded tensors, keyed by global layer (any PP layout)."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    layer_number, out = _layer_numbers(model), {}
    for name, param in model.named_parameters():
        if ".lora." not in name:
            continue
        m = LAYER.match(name)
        key = f"decoder.layers.{layer_number(int(m.group(1)))}.{m.group(2)}"
        if getattr(param, "tensor_model_parallel", False):
            out[key] = make_tp_sharded_tensor_for_checkpoint(param, key, param.partition_dim)
        else:
            out[key] = make_sharded_tensor_for_checkpoint(param, key)
    return out


@torch.no_grad()
def load_state(model, state: dict) -> None:
    """Copy what :func:`sharded_state_dict` loaded back into the adapters."""
    layer_number = _layer_numbers(model)
    for name, param in model.named_parameters():
        if ".lora." in name:
            m = LAYER.match(name)
            param.copy_(state[f"decoder.layers.{layer_number(int(m.group(1)))}.{m.group(2)}"])

