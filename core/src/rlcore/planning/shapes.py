"""Model shapes: the numbers of a Hugging Face ``config.json`` the planner needs, and parameter counts.

The planner never downloads: a recipe's ``policy.model_name`` is read when it is a local directory
(its ``config.json``), else matched against the small table shipped in ``data/shapes.json`` (the
models the recipes, benchmarks and the guide name). Counting is done here by hand rather than by
building the model on the meta device: transformers' import alone takes longer than the whole plan may.

Each architecture family has its reader (:data:`READERS`, by ``model_type``): dense attention with
grouped key-value heads (Llama, Mistral, Qwen2/3), mixtures of experts with routed experts, shared
experts and dense layers (Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3) and multi-head latent attention
(DeepSeek's MLA, whose KV cache is one compressed vector a token and layer). A ``model_type`` no reader
knows, or a config that lacks a field its reader needs, is an error naming them: a shape guessed from
the fields that happen to be there would plan a different model.
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

KEY = "policy.model_name"


@frozen
class LatentAttention:
    """DeepSeek's multi-head latent attention: queries and keys/values through low-rank projections."""

    q_lora_rank: int  # 0: queries projected directly from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, hidden: int, heads: int) -> int:
        if self.q_lora_rank:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
        else:
            q = hidden * heads * self.qk_head_dim
        kv_down = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_down + kv_up + heads * self.v_head_dim * hidden

    @property
    def cache_elements(self) -> int:
        """What an engine caches per token and layer: the compressed KV and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


# Megatron's fused layers and the Hugging Face projections each carries (one adapter per projection)
_MEGATRON_LORA_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                          "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


@frozen
class ModelShape:
    """A decoder-only transformer: dense, or a mixture of experts (routed experts, optionally shared
    experts beside them and leading layers with a dense MLP); grouped-query or latent attention.

    For latent attention ``head_dim`` is the mean of the query-key and value head sizes (so ``q_dim``
    gives the attention FLOPs) and ``kv_heads`` is ``heads`` (training materializes a key and value per head).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # the dense MLP's width (every layer of a dense model; a MoE model's dense layers)
    vocab: int
    tied: bool
    experts: int = 0  # routed experts of a MoE layer
    topk: int = 0
    moe_ffn: int = 0  # one routed expert's width
    shared_ffn: int = 0  # a MoE layer's shared experts, their widths summed (0: none)
    dense_layers: int = 0  # layers of a MoE model with a dense MLP instead of experts
    mla: LatentAttention | None = None
    layer_extras: int = 0  # per layer, small weights beside the matrices and norms (biases, query/key norms)
    moe_layer_extras: int = 0  # per MoE layer, likewise (a shared expert's gate, a routing bias)
    value_head: bool = False  # a critic: one value per token in place of the vocabulary's logits

    @property
    def output_width(self) -> int:
        """Values a token's output layer computes: the vocabulary's logits, or a critic's one value."""
        return 1 if self.value_head else self.vocab

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attn_params(self) -> int:
        if self.mla is not None:
            return self.mla.params(self.hidden, self.heads)
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim

    @property
    def expert_params(self) -> int:
        """One routed expert's (or the dense MLP's, for a dense model) weights: gate, up, down."""
        return 3 * self.hidden * (self.moe_ffn if self.moe else self.ffn)

    @property
    def _nonrouted_params(self) -> int:
        """Every layer's weights outside the routed experts: attention, norms, routers, shared experts, dense MLPs."""
        mlp = (self.layers - self.moe_layers) * 3 * self.hidden * self.ffn
        moe = self.moe_layers * (self.hidden * self.experts + 3 * self.hidden * self.shared_ffn + self.moe_layer_extras)
        return self.layers * (self.attn_params + 2 * self.hidden + self.layer_extras) + mlp + moe

    @property
    def dense_layer_params(self) -> float:
        """Per layer (the mean over layers), what is not inside a routed expert."""
        return self._nonrouted_params / self.layers

    @property
    def routed_layer_params(self) -> float:
        """Per layer (the mean over layers), the routed experts' weights."""
        return self.expert_total_params / self.layers

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (0 if self.tied and not self.value_head else self.output_width * self.hidden)

    @property
    def expert_total_params(self) -> int:
        return self.moe_layers * self.experts * self.expert_params

    @property
    def total_params(self) -> int:
        return self._nonrouted_params + self.expert_total_params + self.embedding_params + self.hidden

    @property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies with: every layer's attention, its router, shared experts and chosen
        experts (or dense MLP), and the output layer (the input embedding is a lookup)."""
        chosen = self.moe_layers * self.topk * self.expert_params
        return self._nonrouted_params - self.layers * 2 * self.hidden + chosen + self.output_width * self.hidden

    def lora_params(self, rank: int, targets) -> int:
        """Adapter weights (``rank`` x (in + out) a projection) on the named projections of every layer, by their
        Hugging Face or Megatron names (``linear_qkv`` = q, k and v; ``linear_fc1`` = gate and up). A MoE layer's
        adapters sit on its shared experts' MLP, the routed experts take none."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        dense_mlp_layers, moe_mlp = self.layers - self.moe_layers, self.shared_ffn
        widths = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        mlp = {"gate_proj": lambda f: (h, f), "up_proj": lambda f: (h, f), "down_proj": lambda f: (f, h)}
        names = set()
        for target in targets:
            names.update(_MEGATRON_LORA_TARGETS.get(target, (target,)))
        per_layer = sum(sum(widths[n]) for n in names if n in widths)
        total = self.layers * rank * per_layer
        for name in names & set(mlp):
            total += rank * (dense_mlp_layers * sum(mlp[name](self.ffn)) + self.moe_layers * sum(mlp[name](moe_mlp)) * bool(moe_mlp))
        return int(total)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        if self.mla is not None:
            return self.layers * self.mla.cache_elements * dtype_bytes
        return 2 * self.layers * self.kv_dim * dtype_bytes

    def kv_shards(self, engine_tp: int) -> int:
        """Over how many of an engine's tensor-parallel GPUs a token's KV cache is split: its key-value
        heads (replicated past their count); latent attention's one compressed vector is on every GPU."""
        return 1 if self.mla is not None else min(engine_tp, self.kv_heads)

    def as_critic(self) -> ModelShape:
        """The value model PPO trains from this one: the same body, a one-wide head in place of the output layer."""
        return attrs.evolve(self, value_head=True, name=f"{self.name} critic")

    def with_layers(self, layers: int) -> ModelShape:
        return attrs.evolve(self, layers=layers, dense_layers=min(self.dense_layers, layers),
                            name=f"{self.name} x{layers} layers")


class _Fields:
    """Reads a config dict, collecting every missing or invalid field so one error names them all."""

    def __init__(self, name: str, cfg: dict):
        self.name, self.cfg, self.missing, self.invalid = name, cfg, [], []

    def int(self, key: str, default: int | None = None, *, minimum: int = 1, alias: str | None = None) -> int:
        """``alias``: the name transformers' own serialization uses where it differs from the published files'."""
        value = self.cfg.get(key)
        if value is None and alias is not None:
            key, value = (alias, self.cfg[alias]) if self.cfg.get(alias) is not None else (key, None)
        if value is None:
            if default is None:
                self.missing.append(repr(key) + (f" (or {alias!r})" if alias else ""))
                return minimum
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.invalid.append(f"{key}={value!r} (expected an integer >= {minimum})")
            return minimum
        return value

    def require_present(self, key: str) -> None:
        """A key whose value may be null (e.g. DeepSeek's ``q_lora_rank``) but must be there."""
        if key not in self.cfg:
            self.missing.append(repr(key))

    def check(self) -> None:
        where = f"{self.name}: config.json (model_type {self.cfg.get('model_type')!r})"
        if self.missing:
            raise ConfigError(KEY, f"{where} lacks {', '.join(self.missing)}")
        if self.invalid:
            raise ConfigError(KEY, f"{where} has {', '.join(self.invalid)}")


def _common(f: _Fields) -> dict:
    hidden, heads = f.int("hidden_size"), f.int("num_attention_heads")
    return dict(hidden=hidden, layers=f.int("num_hidden_layers"), heads=heads, vocab=f.int("vocab_size"),
                tied=bool(f.cfg.get("tie_word_embeddings", False)), ffn=f.int("intermediate_size"))


def _gqa(f: _Fields, common: dict) -> dict:
    """Grouped-query attention, with the small weights each layer has beside the matrices: Qwen2's QKV biases,
    Qwen3's query and key norms, Llama's and Mistral's optional attention and MLP biases."""
    heads, hidden = common["heads"], common["hidden"]
    kv_heads, head_dim = f.int("num_key_value_heads", heads), f.int("head_dim", max(1, hidden // heads))
    q, kv, family = heads * head_dim, kv_heads * head_dim, str(f.cfg.get("model_type"))
    if family.startswith("qwen2"):
        extras = q + 2 * kv
    elif family.startswith("qwen3"):
        extras = 2 * head_dim
    else:
        extras = (q + 2 * kv + hidden if f.cfg.get("attention_bias") else 0) + (2 * common["ffn"] + hidden if f.cfg.get("mlp_bias") else 0)
    return dict(kv_heads=kv_heads, head_dim=head_dim, layer_extras=extras)


def _dense(f: _Fields) -> dict:
    common = _common(f)
    return {**common, **_gqa(f, common)}


def _qwen_moe(f: _Fields) -> dict:
    """Qwen2-MoE / Qwen3-MoE: experts every ``decoder_sparse_step`` layers except ``mlp_only_layers``."""
    common = _common(f)
    layers, step = common["layers"], f.int("decoder_sparse_step", 1)
    mlp_only = set(f.cfg.get("mlp_only_layers") or ())
    dense = sum(1 for i in range(layers) if i in mlp_only or (i + 1) % step)
    shared = f.int("shared_expert_intermediate_size", 0, minimum=0)  # Qwen2-MoE's; Qwen3-MoE has none
    return {**common, **_gqa(f, common), "experts": f.int("num_experts", alias="num_local_experts"), "topk": f.int("num_experts_per_tok"),
            "moe_ffn": f.int("moe_intermediate_size"), "shared_ffn": shared, "dense_layers": dense,
            "moe_layer_extras": common["hidden"] if shared else 0}  # the shared expert's gate


def _mixtral(f: _Fields) -> dict:
    common = _common(f)
    return {**common, **_gqa(f, common), "experts": f.int("num_local_experts", alias="num_experts"), "topk": f.int("num_experts_per_tok"),
            "moe_ffn": common["ffn"]}


def _deepseek(f: _Fields) -> dict:
    """DeepSeek-V2/V3: latent attention; routed and shared experts after ``first_k_dense_replace`` dense layers.
    The multi-token-prediction module (``num_nextn_predict_layers``) is not counted: RL trains without it."""
    common = _common(f)
    f.require_present("q_lora_rank")
    if f.cfg.get("moe_layer_freq", 1) != 1:
        f.invalid.append(f"moe_layer_freq={f.cfg['moe_layer_freq']!r} (the planner models experts in every layer after the dense ones)")
    mla = LatentAttention(q_lora_rank=f.int("q_lora_rank", 0, minimum=0), kv_lora_rank=f.int("kv_lora_rank"),
                          qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=f.int("qk_rope_head_dim"),
                          v_head_dim=f.int("v_head_dim"))
    moe_ffn = f.int("moe_intermediate_size")
    return {**common, "kv_heads": common["heads"], "head_dim": (mla.qk_head_dim + mla.v_head_dim) // 2, "mla": mla,
            "experts": f.int("n_routed_experts"), "topk": f.int("num_experts_per_tok"), "moe_ffn": moe_ffn,
            "shared_ffn": f.int("n_shared_experts", minimum=0) * moe_ffn,
            "dense_layers": min(f.int("first_k_dense_replace", minimum=0), common["layers"]),
            "moe_layer_extras": f.int("n_routed_experts") if f.cfg.get("model_type") == "deepseek_v3" else 0}  # routing score bias


READERS = {
    "llama": _dense, "mistral": _dense, "qwen2": _dense, "qwen3": _dense,
    "qwen2_vl_text": _dense, "qwen2_5_vl_text": _dense, "qwen3_vl_text": _dense,
    "qwen2_moe": _qwen_moe, "qwen3_moe": _qwen_moe, "qwen3_vl_moe_text": _qwen_moe,
    "mixtral": _mixtral, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
}


def from_hf_config(name: str, cfg: dict) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face config dict (a vision-language model's ``text_config``).

    Raises :class:`ConfigError` naming an unknown ``model_type`` or every field its reader lacks."""
    cfg = cfg.get("text_config") or cfg
    model_type = cfg.get("model_type")
    reader = READERS.get(model_type)
    if reader is None:
        raise ConfigError(KEY, f"{name}: config.json has model_type {model_type!r}, which the planner cannot count "
                          f"(it reads {', '.join(sorted(READERS))})")
    fields = _Fields(name, cfg)
    values = reader(fields)
    fields.check()
    shape = ModelShape(name=name, **values)
    _check_consistent(shape, cfg)
    return shape


def _check_consistent(shape: ModelShape, cfg: dict) -> None:
    where = f"{shape.name}: config.json"
    if shape.heads % shape.kv_heads:
        raise ConfigError(KEY, f"{where}: num_attention_heads={shape.heads} is not a multiple of num_key_value_heads={shape.kv_heads}")
    if shape.moe and shape.topk > shape.experts:
        raise ConfigError(KEY, f"{where}: num_experts_per_tok={shape.topk} is more than the {shape.experts} routed experts")


@cache
def _table() -> dict:
    text = resources.files("rlcore.planning").joinpath("data/shapes.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def known_shapes() -> list[str]:
    return sorted(_table())


def resolve_shape(model_name: str, shape: str | None = None, layers: int | None = None) -> ModelShape:
    """The shape of ``model_name`` (a local directory with ``config.json``, or a name the table knows),
    or of ``shape`` (a table name or a benchmark alias) when given. ``layers`` overrides the depth."""
    if layers is not None and layers < 1:
        raise ConfigError("--layers", f"must be a positive layer count, got {layers}")
    found = _lookup(shape, exact=True) if shape else None
    if shape and found is None:
        raise ConfigError("--shape", f"unknown shape {shape!r}; known: {', '.join(known_shapes())} (and their aliases)")
    if found is None:
        found = _from_directory(model_name) or _lookup(model_name, exact=False)
    if found is None:
        raise ConfigError(KEY, f"{model_name!r} is neither a local model directory (with config.json) nor a "
                          f"shape the planner ships ({', '.join(known_shapes())}); give --shape NAME or a local path")
    return found.with_layers(layers) if layers else found


def _from_directory(model_name: str) -> ModelShape | None:
    path = Path(os.path.expanduser(model_name)) / "config.json"
    if not path.is_file():
        return None
    return from_hf_config(Path(model_name).name, json.loads(path.read_text()))


def _lookup(name: str, *, exact: bool) -> ModelShape | None:
    key = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for table_name, entry in _table().items():
        names = [table_name, *entry.get("aliases", ())]
        if key in names or (not exact and any(m in key for m in entry["match"])):
            return from_hf_config(table_name, entry)
    return None
