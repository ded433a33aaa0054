"""From a run's config to the planner's inputs, and back: the recipe's own layout, the keys that bind
the search, and the config values of a chosen layout.

The planner reads the resolved config as plain data (:func:`rlcore.config.to_dict`), never a plugin's
config class: the key names below are the backends' and the generator's documented keys.
"""

from __future__ import annotations

from attrs import frozen

from rlcore.config import RunConfig, to_dict
from rlcore.planning import search as _search
from rlcore.planning.calibration import Calibration, load_calibration
from rlcore.planning.hardware import Cluster, gpu
from rlcore.planning.layout import Layout, Workload
from rlcore.planning.shapes import ModelShape, resolve_shape

MEGATRON = "policy.megatron_cfg"
DTENSOR = "policy.dtensor_cfg"
# config key -> Layout field, per backend (the keys a user may set to bind the search)
MEGATRON_KEYS = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp", "context_parallel_size": "cp",
                 "expert_model_parallel_size": "ep", "expert_tensor_parallel_size": "etp", "sequence_parallel": "sp",
                 "activation_checkpointing": "recompute"}
DTENSOR_KEYS = {"tensor_parallel_size": "tp", "sequence_parallel": "sp", "activation_checkpointing": "recompute",
                "cpu_offload": "offload"}
GENERATION_KEYS = {"tensor_parallel_size": "gen_tp", "num_replicas": "gen_replicas"}


@frozen
class Inputs:
    shape: ModelShape
    work: Workload
    cluster: Cluster
    cal: Calibration
    backend: str
    recipe_layout: Layout
    fixed: dict  # Layout field -> value the search must keep
    auto: bool  # the backend section asks for layout: auto


def _recompute(value) -> str:
    return "full" if value in (True, "full") else ("selective" if value == "selective" else "none")


def _fraction(value) -> float:
    """The recipe's engine share of a GPU; 0 = the planner sizes it (``auto``, or no such key)."""
    return 0.0 if value in (None, "auto") else float(value)


def backend_of(tree: dict) -> str:
    return "megatron" if (tree["policy"].get("megatron_cfg") or {}).get("enabled") else "fsdp2"


def inputs(config: RunConfig, *, gpus: int | None = None, nodes: int | None = None, gpu_name: str = "h200",
           shape: str | None = None, layers: int | None = None, prompt_tokens: int | None = None,
           response_tokens: int | None = None, calibration: Calibration | None = None, world: int | None = None,
           model: ModelShape | None = None) -> Inputs:
    tree = to_dict(config)
    policy, gen = tree["policy"], tree["policy"].get("generation") or {}
    backend = backend_of(tree)
    section = policy.get("megatron_cfg" if backend == "megatron" else "dtensor_cfg") or {}
    model = model or resolve_shape(policy["model_name"], shape, layers)
    nodes = nodes or (1 if gpus else config.cluster.num_nodes)
    if world is not None:
        cluster = Cluster(gpu(gpu_name), 1, world)
    else:
        per_node = (gpus // nodes if gpus else config.cluster.gpus_per_node) or 1
        cluster = Cluster(gpu(gpu_name), nodes, per_node)
    work = workload(config, tree, prompt_tokens, response_tokens, has_generator=bool(gen.get("backend")))
    auto = section.get("layout") == "auto"
    explicit = config.section(MEGATRON if backend == "megatron" else DTENSOR).explicit_keys if auto else frozenset()
    return Inputs(model, work, cluster, calibration or load_calibration(gpu_name), backend,
                  recipe_layout(tree, backend, section, gen), fixed_keys(backend, section, explicit, gen, config), auto)


def workload(config: RunConfig, tree: dict, prompt_tokens: int | None, response_tokens: int | None, *,
             has_generator: bool) -> Workload:
    policy, gen = config.policy, tree["policy"].get("generation") or {}
    max_seq = policy.max_total_sequence_length
    response = min(response_tokens or gen.get("max_new_tokens", 256), max_seq - 1)
    prompt = prompt_tokens or max(1, min(256, max_seq - response))
    samples = config.train.num_prompts_per_step * config.grpo.num_generations_per_prompt
    algorithm = tree.get("algorithm") or {}
    minibatches = policy.train_global_batch_size is not None and policy.train_global_batch_size < samples
    passes = int(minibatches or config.grpo.async_grpo.enabled) + int(float(algorithm.get("kl_coef") or 0) > 0)
    mcfg = tree["policy"].get("megatron_cfg") or {}
    ddp = mcfg.get("distributed_data_parallel_config") or {}
    megatron = bool(mcfg.get("enabled"))
    return Workload(
        samples=samples, prompt_tokens=prompt, response_tokens=response, max_seq=max_seq,
        packing=policy.sequence_packing.enabled, micro_batch_size=policy.train_micro_batch_size, logprob_passes=passes,
        generation=has_generator, max_num_seqs=int(gen.get("max_num_seqs", 256)),
        dtype_bytes=4 if policy.precision in ("float32", "float64") else 2,
        grad_bytes=4 if (not megatron or ddp.get("grad_reduce_in_fp32", True)) else 2,
        overlap_grad_reduce=bool(ddp.get("overlap_grad_reduce")) if megatron else False,
        graph_pool=megatron and mcfg.get("cuda_graph", "none") != "none",
    )


def recipe_layout(tree: dict, backend: str, section: dict, gen: dict) -> Layout:
    packing = tree["policy"].get("sequence_packing") or {}
    colocated = (gen.get("colocated") or {}).get("enabled", True)
    resources = (gen.get("colocated") or {}).get("resources") or {}
    common = dict(train_mb_tokens=packing.get("train_mb_tokens", 4096), logprob_mb_tokens=packing.get("logprob_mb_tokens", 8192),
                  colocated=colocated, gen_gpus=0 if colocated else resources.get("gpus_per_node", 0) * resources.get("num_nodes", 1),
                  gen_tp=gen.get("tensor_parallel_size", 1), gen_memory_fraction=_fraction(gen.get("gpu_memory_utilization")))
    if backend == "fsdp2":
        tp = section.get("tensor_parallel_size", 1)
        return Layout(backend="fsdp2", tp=tp, sp=bool(section.get("sequence_parallel")),
                      recompute=_recompute(section.get("activation_checkpointing")), offload=bool(section.get("cpu_offload")),
                      release=(gen.get("colocated") or {}).get("offload_trainer_state") is True, **common)
    tp = section.get("tensor_model_parallel_size", 1)
    return Layout(tp=tp, pp=section.get("pipeline_model_parallel_size", 1), cp=section.get("context_parallel_size", 1),
                  ep=section.get("expert_model_parallel_size", 1), etp=section.get("expert_tensor_parallel_size") or tp,
                  sp=bool(section.get("sequence_parallel")), recompute=_recompute(section.get("activation_checkpointing")),
                  offload=(gen.get("colocated") or {}).get("offload_trainer_state") is True, **common)


def fixed_keys(backend: str, section: dict, explicit: frozenset, gen: dict, config: RunConfig) -> dict:
    """Layout fields the search keeps: the keys a ``layout: auto`` section sets; the micro-batch budgets and
    the generation layout are the recipe's (the run applies only the backend's keys)."""
    keys = MEGATRON_KEYS if backend == "megatron" else DTENSOR_KEYS
    fixed = {}
    for key in explicit & set(keys):
        value = section[key]
        fixed[keys[key]] = _recompute(value) if keys[key] == "recompute" else value
    return fixed


def plan(inp: Inputs, *, fixed: dict | None = None, virtual_stages: bool = False, keep: int = 40, uneven_gather: bool = True) -> list:
    return _search.search(inp.shape, inp.work, inp.cluster, inp.cal, backend=inp.backend, fixed={**inp.fixed, **(fixed or {})},
                          virtual_stages=virtual_stages, keep=keep, uneven_gather=uneven_gather)


def evaluate_recipe(inp: Inputs):
    return _search.evaluate(inp.shape, inp.work, inp.recipe_layout, inp.cluster, inp.cal)
