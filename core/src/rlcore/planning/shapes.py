"""Model shapes: the few numbers of a Hugging Face ``config.json`` the planner needs, and parameter counts.

The planner never downloads: a recipe's ``policy.model_name`` is read when it is a local directory
(its ``config.json``), else matched against the small table shipped in ``data/shapes.json`` (the
models the recipes and benchmarks name). Counting is done here by hand rather than by building the
model on the meta device: transformers' import alone takes longer than the whole plan may.
"""

from __future__ import annotations

import json
import os
from functools import cache
from importlib import resources
from pathlib import Path

import attrs
from attrs import frozen

from rlcore.config.structure import ConfigError


@frozen
class ModelShape:
    """A decoder-only transformer (dense, or mixture of experts in every layer)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attn_params(self) -> int:
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim

    @property
    def expert_params(self) -> int:
        """One expert's (or the dense MLP's, for a dense model) weights: gate, up, down."""
        return 3 * self.hidden * (self.moe_ffn if self.moe else self.ffn)

    @property
    def dense_layer_params(self) -> int:
        """Per layer, what is not inside an expert: attention, norms, router, (dense) MLP."""
        router = self.hidden * self.experts if self.moe else 0
        mlp = 0 if self.moe else self.expert_params
        return self.attn_params + router + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def total_params(self) -> int:
        experts = self.layers * self.experts * self.expert_params
        return self.layers * self.dense_layer_params + experts + self.embedding_params + self.hidden

    @property
    def expert_total_params(self) -> int:
        return self.layers * self.experts * self.expert_params

    @property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies with: every layer's attention (+ router) and its chosen experts,
        and the output layer (the input embedding is a lookup)."""
        per_layer = self.dense_layer_params - 2 * self.hidden + (self.topk * self.expert_params if self.moe else 0)
        return self.layers * per_layer + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_dim * dtype_bytes

    def with_layers(self, layers: int) -> ModelShape:
        return attrs.evolve(self, layers=layers, name=f"{self.name} x{layers} layers")


def from_hf_config(name: str, cfg: dict) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face config dict (Llama, Qwen2/3, Qwen3-MoE, Mistral keys)."""
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        return ModelShape(
            name=name, hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or hidden // heads),
            ffn=int(cfg.get("intermediate_size") or 4 * hidden), vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)), experts=experts,
            topk=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0) if experts else 0,
        )
    except KeyError as exc:
        raise ConfigError("policy.model_name", f"{name}: config.json lacks {exc.args[0]!r}") from exc


@cache
def _table() -> dict:
    text = resources.files("rlcore.planning").joinpath("data/shapes.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def known_shapes() -> list[str]:
    return sorted(_table())


def resolve_shape(model_name: str, shape: str | None = None, layers: int | None = None) -> ModelShape:
    """The shape of ``model_name`` (a local directory with ``config.json``, or a name the table knows),
    or of ``shape`` (a table name or a benchmark alias) when given. ``layers`` overrides the depth."""
    found = _lookup(shape, exact=True) if shape else None
    if shape and found is None:
        raise ConfigError("--shape", f"unknown shape {shape!r}; known: {', '.join(known_shapes())} (and their aliases)")
    if found is None:
        found = _from_directory(model_name) or _lookup(model_name, exact=False)
    if found is None:
        raise ConfigError("policy.model_name", f"{model_name!r} is neither a local model directory (with config.json) nor a "
                          f"shape the planner ships ({', '.join(known_shapes())}); give --shape NAME or a local path")
    return found.with_layers(layers) if layers else found


def _from_directory(model_name: str) -> ModelShape | None:
    path = Path(os.path.expanduser(model_name)) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    return from_hf_config(Path(model_name).name, cfg.get("text_config", cfg))


def _lookup(name: str, *, exact: bool) -> ModelShape | None:
    key = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for table_name, entry in _table().items():
        names = [table_name, *entry.get("aliases", ())]
        if key in names or (not exact and any(m in key for m in entry["match"])):
            return from_hf_config(table_name, entry)
    return None
