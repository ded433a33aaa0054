"""What the planner refuses before it estimates anything: counts that are not positive, GPUs that do not
split over the nodes, lengths that do not fit the sequence limit, and parallel sizes that do not divide
the GPUs, the attention heads, the layers or the experts. Each error is one :class:`ConfigError` naming the
key (a config key, or the command-line flag that set the value).

The backends check the same divisibility when they build (``rlcore_megatron.config.validate_parallelism``,
the FSDP2 plugin's ``ParallelDims``); the planner checks it itself because the core imports no plugin and
``rlcore plan`` must answer for runs on GPUs it does not have.
"""

from __future__ import annotations

import math

from rlcore.config.structure import ConfigError
from rlcore.planning.layout import Layout
from rlcore.planning.shapes import ModelShape

MEGATRON_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
                 "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"}
GENERATION = "policy.generation"


def positive(key: str, value, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(key, f"must be a positive {what}, got {value!r}")


def cluster_size(gpus: int | None, nodes: int | None, recipe_nodes: int, recipe_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) from ``--gpus`` / ``--nodes`` and the recipe's cluster section.

    ``--gpus`` alone fills nodes of the recipe's ``cluster.gpus_per_node`` (64 GPUs of 8-GPU nodes: 8 nodes)."""
    positive("--gpus", gpus, "GPU count")
    positive("--nodes", nodes, "node count")
    if gpus is None:
        nodes = nodes or recipe_nodes
        if recipe_per_node < 1:
            raise ConfigError("cluster.gpus_per_node", f"is {recipe_per_node}: the recipe runs on CPU; give --gpus N to plan GPUs")
        return nodes, recipe_per_node
    if nodes is None:
        nodes = math.ceil(gpus / recipe_per_node) if recipe_per_node >= 1 else 1
        if gpus % nodes:
            raise ConfigError("--nodes", f"{gpus} GPUs do not fill {nodes} nodes of cluster.gpus_per_node={recipe_per_node} "
                              "evenly; give --nodes")
    elif gpus % nodes:
        raise ConfigError("--nodes", f"--gpus {gpus} does not split evenly over {nodes} nodes")
    return nodes, gpus // nodes


def lengths(prompt: int | None, response: int | None, response_max: int | None, max_seq: int) -> None:
    """The lengths given on the command line, against ``policy.max_total_sequence_length``."""
    positive("--prompt-tokens", prompt, "token count")
    positive("--response-tokens", response, "token count")
    positive("--response-max", response_max, "token count")
    if response is not None and response_max is not None and response_max < response:
        raise ConfigError("--response-max", f"{response_max} is shorter than the mean response (--response-tokens {response})")
    longest = response_max or response
    if longest is not None and (prompt or 1) + longest > max_seq:
        flag = "--response-max" if response_max else "--response-tokens"
        after = f"after {prompt} prompt tokens" if prompt else "with a prompt"
        raise ConfigError(flag, f"{longest} response tokens {after} exceed policy.max_total_sequence_length={max_seq}")


def recipe_layout(shape: ModelShape, lay: Layout, world: int, backend: str, section: dict, *, generation: bool) -> None:
    """The recipe's own layout on ``world`` GPUs: every size positive, dividing what it splits (the engines'
    too, when the run generates)."""
    prefix = "policy.megatron_cfg." if backend == "megatron" else "policy.dtensor_cfg."
    names = MEGATRON_KEYS if backend == "megatron" else {"tp": "tensor_parallel_size"}
    key = {field: prefix + name for field, name in names.items()}
    for field in names:
        positive(key[field], getattr(lay, field), "parallel size")
    train = lay.train_world(world)
    if not lay.colocated and not 1 <= lay.gen_gpus < world:
        raise ConfigError(f"{GENERATION}.colocated.resources", f"{lay.gen_gpus} GPUs for generation leave "
              f"{max(train, 0)} of the {world} for training")
    model_parallel = lay.tp * lay.pp * lay.cp
    if train % model_parallel:
        sizes = " x ".join(f"{names[f]} ({getattr(lay, f)})" for f in ("tp", "pp", "cp") if f in names)
        raise ConfigError(key["tp"], f"{sizes} = {model_parallel} does not divide the {train} training GPUs")
    for count, what in ((shape.heads, "attention heads"), (shape.kv_heads, "key/value heads")):
        if count % lay.tp:
            raise ConfigError(key["tp"], f"{lay.tp} does not divide the model's {count} {what}")
    if backend == "megatron":
        _megatron_sizes(shape, lay, train, key, section)
    if generation:
        _engine(shape, lay, world)


def _megatron_sizes(shape: ModelShape, lay: Layout, train: int, key: dict, section: dict) -> None:
    uneven = section.get("num_layers_in_first_pipeline_stage") or section.get("num_layers_in_last_pipeline_stage")
    if lay.pp > shape.layers or (shape.layers % lay.pp and not uneven):
        raise ConfigError(key["pp"], f"{lay.pp} stages do not divide the model's {shape.layers} layers")
    if not shape.moe:
        if lay.ep > 1:
            raise ConfigError(key["ep"], f"is {lay.ep} but the model is dense (no experts)")
        return
    if shape.experts % lay.ep:
        raise ConfigError(key["ep"], f"{lay.ep} does not divide the model's {shape.experts} experts")
    if train % (lay.etp * lay.ep * lay.pp):
        raise ConfigError(key["ep"], f"expert_tensor_parallel_size ({lay.etp}) x expert_model_parallel_size ({lay.ep}) x "
              f"pipeline_model_parallel_size ({lay.pp}) = {lay.etp * lay.ep * lay.pp} does not divide the {train} training GPUs")


def _engine(shape: ModelShape, lay: Layout, world: int) -> None:
    key = f"{GENERATION}.tensor_parallel_size"
    positive(key, lay.gen_tp, "parallel size")
    gpus = world if lay.colocated else lay.gen_gpus
    if gpus % lay.gen_tp:
        raise ConfigError(key, f"{lay.gen_tp} does not divide the {gpus} generation GPUs")
    if shape.heads % lay.gen_tp:
        raise ConfigError(key, f"{lay.gen_tp} does not divide the model's {shape.heads} attention heads")
