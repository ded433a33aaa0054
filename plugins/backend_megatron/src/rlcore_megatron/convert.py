"""Hugging Face <-> Megatron-Core weights, in memory, with TP / PP / EP / ETP sharding.

Loading (:func:`load_hf_into_megatron`): every rank reads only the Hugging Face tensors its
shard needs (safetensors, lazily) and copies its slice into the local Megatron parameters.
Exporting (:func:`iter_hf_weights`): each pipeline stage gathers its tensor- and
expert-parallel shards back into full Hugging Face tensors, then stages take turns
broadcasting theirs to pipeline rank 0; global rank 0 yields ``(hf_name, tensor)``.

Megatron's fused layouts (local spec):
- ``linear_qkv`` rows are grouped per key/value head: ``[q heads of group g, k_g, v_g]`` for each
  group g, so a TP shard is a contiguous block of groups.
- ``linear_fc1`` is ``[gate; up]``, and a TP shard is ``[gate_r; up_r]``.
- Row-parallel ``linear_proj``/``linear_fc2`` are split along the input dimension.
- MoE experts come in three layouts: one module per expert (``local_experts.<i>``, the loop), one
  weight per expert (``weight<i>``, TE's grouped linear), or one stacked tensor per projection
  (``[local experts, rows, cols]``, torch's grouped GEMM); each expert's rows are its HF tensors.

Why the conversion is ours rather than Megatron-Bridge's: Megatron-Bridge 0.6.2 needs Python 3.12
and brings flashinfer, mlflow, comet-ml, diffusers, timm, a pinned wandb and ``transformers<=5.12.1``
into every environment that installs this plugin, which would exclude the transformers releases
users run beside it. The layouts above are the few that the supported architectures need, and
they are the same in megatron-core 0.16.1 and 0.19.x.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
# Grouped GEMM (TE's grouped linear, ``TEGroupedMLP``): one module per projection, one weight per local expert.
GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")
# torch grouped GEMM (rlcore_megatron.moe_grouped_mm): one stacked weight [local experts, rows, cols] per projection.
STACKED_EXPERTS = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight$")


def expert_match(rest: str) -> tuple[int, str] | None:
    """(local expert index, 'linear_fc1' | 'linear_fc2') of a layer-relative Megatron expert weight name, either layout."""
    e = EXPERT.match(rest)
    if e:
        return int(e.group(1)), e.group(2)
    g = GROUPED_EXPERT.match(rest)
    return (int(g.group(2)), g.group(1)) if g else None
LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    # Transformer Engine's spec fuses the pre-norms into the following linear layers.
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
}


@attrs.frozen
class Shape:
    """What the fused layouts need from the model config."""

    num_heads: int
    num_groups: int
    head_dim: int
    tied: bool
    num_experts: int = 0

    @classmethod
    def from_hf(cls, hf_config) -> Shape:
        heads = hf_config.num_attention_heads
        return cls(heads, hf_config.num_key_value_heads, getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                   bool(getattr(hf_config, "tie_word_embeddings", False)), int(getattr(hf_config, "num_experts", 0) or 0))


class HFReader:
    """Lazy access to a Hugging Face checkpoint's safetensors by name."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        from rlcore.utils import local_model_dir

        path = Path(local_model_dir(str(path)))  # a hub id: its snapshot in the huggingface_hub cache
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(path.glob("*.safetensors"))]
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self._handles = [safe_open(str(path / f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"Hugging Face checkpoint has no tensor {name!r}")
        return self._where[name].get_tensor(name)


def _chunk(t: torch.Tensor, n: int, r: int, dim: int = 0) -> torch.Tensor:
    return torch.chunk(t, n, dim=dim)[r]


def fuse_qkv(q, k, v, s: Shape) -> torch.Tensor:
    """HF q/k/v ([heads*d, ...], [groups*d, ...]) -> Megatron's grouped ``linear_qkv`` layout."""
    rest = q.shape[1:]
    per = s.num_heads // s.num_groups
    q = q.reshape(s.num_groups, per * s.head_dim, *rest)
    k = k.reshape(s.num_groups, s.head_dim, *rest)
    v = v.reshape(s.num_groups, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv, s: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = qkv.shape[1:]
    per = s.num_heads // s.num_groups
    grouped = qkv.reshape(s.num_groups, (per + 2) * s.head_dim, *rest)
    q, k, v = torch.split(grouped, [per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _fc1(gate, up, n, r):
    return torch.cat([_chunk(gate, n, r), _chunk(up, n, r)], dim=0)


def megatron_value(local: str, get: Callable[[str], torch.Tensor], s: Shape, global_layer: Callable[[int], int],
                   expert_offset: int) -> torch.Tensor:
    """The value of local Megatron parameter ``local`` on this rank, from HF tensors ``get(name)``."""
    tp, tpr = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    if local == "embedding.word_embeddings.weight":
        return _chunk(get("model.embed_tokens.weight"), tp, tpr)
    if local == "output_layer.weight":
        return _chunk(get("model.embed_tokens.weight" if s.tied else "lm_head.weight"), tp, tpr)
    if local == "decoder.final_layernorm.weight":
        return get("model.norm.weight")
    m = LAYER.match(local)
    if not m:
        raise KeyError(f"no Hugging Face source for Megatron parameter {local!r}")
    pre = f"model.layers.{global_layer(int(m.group(1)))}."
    rest = m.group(2)
    if rest in LAYER_MAP:
        return get(pre + LAYER_MAP[rest])
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        qkv = fuse_qkv(*(get(f"{pre}self_attn.{p}_proj.{kind}") for p in "qkv"), s)
        return _chunk(qkv, tp, tpr)
    if rest == "self_attention.linear_proj.weight":
        return _chunk(get(pre + "self_attn.o_proj.weight"), tp, tpr, dim=1)
    if rest == "mlp.linear_fc1.weight":
        return _fc1(get(pre + "mlp.gate_proj.weight"), get(pre + "mlp.up_proj.weight"), tp, tpr)
    if rest == "mlp.linear_fc2.weight":
        return _chunk(get(pre + "mlp.down_proj.weight"), tp, tpr, dim=1)
    stacked = STACKED_EXPERTS.match(rest)
    if stacked:
        experts = range(expert_offset, expert_offset + s.num_experts // mpu.get_expert_model_parallel_world_size())
        xp = f"{pre}mlp.experts."
        if stacked.group(1) == "linear_fc1":
            return torch.stack([torch.cat([get(f"{xp}{i}.gate_proj.weight"), get(f"{xp}{i}.up_proj.weight")]) for i in experts])
        return torch.stack([get(f"{xp}{i}.down_proj.weight") for i in experts])
    e = expert_match(rest)
    if e:
        etp, etpr = mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank()
        xp = f"{pre}mlp.experts.{expert_offset + e[0]}."
        if e[1] == "linear_fc1":
            return _fc1(get(xp + "gate_proj.weight"), get(xp + "up_proj.weight"), etp, etpr)
        return _chunk(get(xp + "down_proj.weight"), etp, etpr, dim=1)
    raise KeyError(f"no Hugging Face source for Megatron parameter {local!r}")


def _skip(name: str, tensor) -> bool:
    """State that is not a base weight: TE/extra state, MoE routing statistics, LoRA adapters (rlcore_megatron.lora)."""
    return tensor is None or not isinstance(tensor, torch.Tensor) or ".lora." in name or name.endswith(
        ("_extra_state", "expert_bias", "local_tokens_per_expert"))


def _layer_numbers(model) -> Callable[[int], int]:
    layers = model.decoder.layers
    return lambda local: int(layers[local].layer_number) - 1


def _expert_offset(s: Shape) -> int:
    if not s.num_experts:
        return 0
    return mpu.get_expert_model_parallel_rank() * (s.num_experts // mpu.get_expert_model_parallel_world_size())


@torch.no_grad()
def load_hf_into_megatron(model, hf_path_or_getter, hf_config) -> None:
    """Copy a Hugging Face checkpoint into this rank's Megatron shard (strict: every parameter is set)."""
    get = HFReader(hf_path_or_getter) if isinstance(hf_path_or_getter, (str, Path)) else hf_path_or_getter
    s = Shape.from_hf(hf_config)
    layer, offset = _layer_numbers(model), _expert_offset(s)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if _skip(name, tensor):
            continue
        if name.startswith(VALUE_HEAD):  # a critic's head (rlcore_megatron.critic), replicated on its ranks
            tensor.data.copy_(value_head_value(name, get, tensor))
            continue
        value = megatron_value(name, get, s, layer, offset)
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name}: Megatron {tuple(tensor.shape)} vs converted {tuple(value.shape)}")
        tensor.data.copy_(value.to(tensor.dtype))


VALUE_HEAD = "value_head."  # a critic's value head; transformers names it ``score`` (rlcore.training.value_model)


def value_head_value(name: str, get: Callable[[str], torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    """The checkpoint's ``score.*`` tensor for a critic's ``value_head.*``; zeros when it has none
    (a causal-LM checkpoint: a fresh head starts at 0, as on the fsdp2 backend)."""
    try:
        return get("score." + name[len(VALUE_HEAD):]).to(tensor.dtype)
    except KeyError:
        return torch.zeros_like(tensor)


# ---- Megatron -> Hugging Face ----------------------------------------------------------------
def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gather_fc1(t: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    n = dist.get_world_size(group)
    parts = [t] if n == 1 else [torch.empty_like(t) for _ in range(n)]
    if n > 1:
        dist.all_gather(parts, t.contiguous(), group=group)
    gates, ups = zip(*(torch.chunk(p, 2, dim=0) for p in parts))
    return torch.cat(gates, 0), torch.cat(ups, 0)


def stage_hf_weights(model, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's full (TP/EP-gathered) tensors in HF names. All ranks of the stage must iterate."""
    s = Shape.from_hf(hf_config)
    tpg, etpg, epg = mpu.get_tensor_model_parallel_group(), mpu.get_expert_tensor_parallel_group(), mpu.get_expert_model_parallel_group()
    layer = _layer_numbers(model)
    for name, t in model.state_dict().items():
        if _skip(name, t):
            continue
        t = t.detach()
        if name.startswith(VALUE_HEAD):
            yield "score." + name[len(VALUE_HEAD):], t
            continue
        if name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", _gather(t, tpg, 0)
            continue
        if name == "output_layer.weight":
            if not s.tied:
                yield "lm_head.weight", _gather(t, tpg, 0)
            continue
        if name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", t
            continue
        m = LAYER.match(name)
        pre, rest = f"model.layers.{layer(int(m.group(1)))}.", m.group(2)
        if rest in LAYER_MAP:
            yield pre + LAYER_MAP[rest], t
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            for p, x in zip("qkv", split_qkv(_gather(t, tpg, 0), s)):
                yield f"{pre}self_attn.{p}_proj.{kind}", x
        elif rest == "self_attention.linear_proj.weight":
            yield pre + "self_attn.o_proj.weight", _gather(t, tpg, 1)
        elif rest == "mlp.linear_fc1.weight":
            gate, up = _gather_fc1(t, tpg)
            yield pre + "mlp.gate_proj.weight", gate
            yield pre + "mlp.up_proj.weight", up
        elif rest == "mlp.linear_fc2.weight":
            yield pre + "mlp.down_proj.weight", _gather(t, tpg, 1)
        elif STACKED_EXPERTS.match(rest):
            yield from _stacked_expert_weights(t, STACKED_EXPERTS.match(rest).group(1), pre, epg)
        else:
            e = expert_match(rest)
            if not e:
                raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")
            yield from _expert_weights(t, e[0], e[1], pre, s, etpg, epg)


def _expert_weights(t, local_idx, kind, pre, s: Shape, etpg, epg):
    ep = dist.get_world_size(epg)
    per_rank = s.num_experts // ep
    full = [t] if ep == 1 else [torch.empty_like(t) for _ in range(ep)]
    if ep > 1:
        dist.all_gather(full, t.contiguous(), group=epg)
    for r, shard in enumerate(full):
        xp = f"{pre}mlp.experts.{r * per_rank + local_idx}."
        if kind == "linear_fc1":
            gate, up = _gather_fc1(shard, etpg)
            yield xp + "gate_proj.weight", gate
            yield xp + "up_proj.weight", up
        else:
            yield xp + "down_proj.weight", _gather(shard, etpg, 1)


def _stacked_expert_weights(t_ERC, kind, pre, epg):
    """Each expert's HF tensors from stacked ``[local experts, rows, cols]`` weights, gathered over EP
    (expert tensor parallelism is 1 in this layout)."""
    full_ERC = _gather(t_ERC, epg, 0)
    for i, w in enumerate(full_ERC):
        xp = f"{pre}mlp.experts.{i}."
        if kind == "linear_fc1":
            gate, up = torch.chunk(w, 2, dim=0)
            yield xp + "gate_proj.weight", gate
            yield xp + "up_proj.weight", up
        else:
            yield xp + "down_proj.weight", w


def iter_hf_weights(model, hf_config, stage: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full model in HF names, yielded on global rank 0; every rank must iterate (collectives).
    ``stage``: what each pipeline stage contributes (default :func:`stage_hf_weights`)."""
    stage = stage or (lambda: stage_hf_weights(model, hf_config))
    pp = mpu.get_pipeline_model_parallel_world_size()
    if pp == 1:
        for name, t in stage():
            if dist.get_rank() == 0:
                yield name, t
        return
    ppg, pp_rank = mpu.get_pipeline_model_parallel_group(), mpu.get_pipeline_model_parallel_rank()
    ranks = dist.get_process_group_ranks(ppg)
    for index in range(pp):
        source = iter(stage()) if index == pp_rank else None
        while True:
            item = next(source, None) if source is not None else None
            meta = [None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
            dist.broadcast_object_list(meta, src=ranks[index], group=ppg)
            if meta[0] is None:
                break
            name, shape, dtype = meta[0]
            t = item[1].contiguous() if item is not None else torch.empty(shape, dtype=dtype, device=_device(model))
            dist.broadcast(t, src=ranks[index], group=ppg)
            if dist.get_rank() == 0:
                yield name, t


def _device(model) -> torch.device:
    return next(model.parameters()).device
