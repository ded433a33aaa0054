"""From a run's config to the planner's inputs, and back: the recipe's own layout, the keys that bind
the search, and the config values of a chosen layout.

The planner reads the resolved config as plain data (:func:`rlcore.loading.loader.to_dict`), never a plugin's
config class: the key names below are the backends' and the generator's documented keys.
"""

from __future__ import annotations

import attrs
from attrs import frozen

from rlcore.config import ConfigError, RunConfig
from rlcore.loading.loader import to_dict
from rlcore.planning import checks, lengths
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
    release_auto: bool = False  # offload_trainer_state: auto, colocated and synchronous (the run decides it; see evaluate_recipe)


def _recompute(value) -> str:
    return "full" if value in (True, "full") else ("selective" if value == "selective" else "none")


def _fraction(value) -> float:
    """The recipe's engine share of a GPU; 0 = the planner sizes it (``auto``, or no such key)."""
    return 0.0 if value in (None, "auto") else float(value)


def backend_of(tree: dict) -> str:
    return "megatron" if (tree["policy"].get("megatron_cfg") or {}).get("enabled") else "fsdp2"


def inputs(config: RunConfig, *, gpus: int | None = None, nodes: int | None = None, gpu_name: str = "h200",
           shape: str | None = None, layers: int | None = None, prompt_tokens: int | None = None,
           response_tokens: int | None = None, response_max: int | None = None, lengths_from: str | None = None,
           calibration: Calibration | None = None, world: int | None = None, model: ModelShape | None = None) -> Inputs:
    """The planner's inputs for ``config``, every one checked (:mod:`rlcore.planning.checks`): a bad count,
    length or parallel size is a :class:`ConfigError` naming its key."""
    tree = to_dict(config)
    model = model or resolve_shape(tree["policy"]["model_name"], shape, layers)
    if world is not None:
        cluster = Cluster(gpu(gpu_name), 1, world)
    else:
        cluster = Cluster(gpu(gpu_name), *checks.cluster_size(gpus, nodes, config.cluster.num_nodes, config.cluster.gpus_per_node))
    layout, work = recipe_work(config, tree, prompt_tokens, response_tokens, response_max=response_max, lengths_from=lengths_from)
    critic = critic_shape(tree, model)
    work = attrs.evolve(work, critic=critic is not None, critic_model=critic)
    if config.policy.lora.enabled:
        work = attrs.evolve(work, lora_params=model.lora_params(config.policy.lora.rank, config.policy.lora.target_modules))
    backend, gen = layout.backend, tree["policy"].get("generation") or {}
    section = _section(tree, backend)
    auto = section.get("layout") == "auto"
    explicit = config.section(MEGATRON if backend == "megatron" else DTENSOR).explicit_keys if auto else frozenset()
    fixed = fixed_keys(backend, section, explicit, gen, config)
    if world is None:  # a run's own callers pass its world; its backend checks its sizes as it builds
        # layout: auto searches the sizes the section leaves out: only those it sets must divide what they split
        bound = layout.with_(**{f: fixed.get(f, 1) for f in ("tp", "pp", "cp", "ep", "etp")}) if auto else layout
        checks.recipe_layout(model, bound, cluster.world, backend, section, generation=work.generation)
    colocated = gen.get("colocated") or {}
    release_auto = (colocated.get("offload_trainer_state", "auto") == "auto" and layout.colocated and not work.one_step_off
                    and work.generation)
    return Inputs(model, work, cluster, calibration or load_calibration(gpu_name), backend, layout, fixed, auto, release_auto)


def _section(tree: dict, backend: str) -> dict:
    return tree["policy"].get("megatron_cfg" if backend == "megatron" else "dtensor_cfg") or {}


def recipe_work(config: RunConfig, tree: dict, prompt_tokens: int | None = None, response_tokens: int | None = None, *,
                response_max: int | None = None, lengths_from: str | None = None) -> tuple[Layout, Workload]:
    """The recipe's own layout and its step's workload, read from ``tree`` (``config`` resolved as plain data); the
    lengths given on the command line checked against the recipe's limit (:func:`rlcore.planning.checks.lengths`)."""
    gen = tree["policy"].get("generation") or {}
    backend = backend_of(tree)
    layout = recipe_layout(tree, backend, _section(tree, backend), gen)
    work = workload(config, tree, prompt_tokens, response_tokens, has_generator=bool(gen.get("backend")),
                    response_max=response_max, lengths_from=lengths_from)
    return layout, work


# settings the planner's model does not price: (config key, the value refused, the value to plan with, why)
UNMODELLED = (
    ("policy.megatron_cfg.fp8_cfg.enabled", True, "false", "FP8 training is not modelled (the training efficiency and "
     "activation bytes are fitted to bf16 rows only)"),
    ("policy.generation.quantization", "fp8", "none", "FP8 rollouts are not modelled (decode is priced reading bf16 "
     "weights and refit moving bf16 bytes; the decode factors are fitted to bf16 rows only)"),
    ("policy.generation.kv_cache_dtype", "fp8", "auto", "an FP8 KV cache is not modelled (the cache's size and the bytes "
     "a decode step reads are priced in bf16)"),
)


def refuse_unmodelled(tree: dict) -> None:
    """``rlcore plan`` refuses a recipe that sets what its model does not price, naming the key, rather than
    planning another run than the one asked for."""
    for key, value, instead, why in UNMODELLED:
        node = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node == value:
            raise ConfigError(key, f"{why}; plan the run with {key}={instead}")


def critic_shape(tree: dict, policy: ModelShape) -> ModelShape | None:
    """PPO's value model: ``algorithm.critic.model_name``'s shape, else the policy's, with a value head."""
    algorithm = tree.get("algorithm") or {}
    if algorithm.get("name") != "ppo":
        return None
    name = (algorithm.get("critic") or {}).get("model_name")
    return (resolve_shape(name) if name else policy).as_critic()


def _lengths(gen: dict, max_seq: int, prompt: int | None, response: int | None, response_max: int | None,
             lengths_from: str | None) -> tuple[int, int, int, float | None]:
    """(prompt, mean response, longest response) tokens, and the sequences' mean square length where a run's
    metrics give the lengths' percentiles (else None). Default: every response at ``max_new_tokens`` (the worst
    case); a mean alone keeps the longest at that limit (a step's tail usually reaches it)."""
    checks.lengths(prompt, response, response_max, max_seq)
    if lengths_from is not None:
        if response is not None or response_max is not None:
            raise ConfigError(lengths.FLAG, "reads the response lengths: give it or --response-tokens / --response-max, not both")
        found = lengths.from_metrics(lengths_from)
        prompt = prompt or max(1, round(found.prompt))
        response, response_max = max(1, round(found.response_mean)), max(1, round(found.response_max))
        if prompt + response_max > max_seq:
            raise ConfigError(lengths.FLAG, f"{lengths_from}: {prompt} prompt + {response_max} response tokens exceed "
                              f"policy.max_total_sequence_length={max_seq}")
        return prompt, response, response_max, found.seq_sq_mean(prompt)
    limit = min(int(gen.get("max_new_tokens", 256)), max_seq - 1)
    prompt = prompt or max(1, min(256, max_seq - (response_max or response or limit)))
    longest = min(response_max or max(limit, response or 0), max_seq - prompt)
    return prompt, min(response or longest, longest), longest, None


def workload(config: RunConfig, tree: dict, prompt_tokens: int | None, response_tokens: int | None, *,
             has_generator: bool, response_max: int | None = None, lengths_from: str | None = None) -> Workload:
    policy, gen = config.policy, tree["policy"].get("generation") or {}
    max_seq = policy.max_total_sequence_length
    prompt, response, longest, sq_mean = _lengths(gen, max_seq, prompt_tokens, response_tokens, response_max, lengths_from)
    samples = config.train.num_prompts_per_step * config.grpo.num_generations_per_prompt
    algorithm = tree.get("algorithm") or {}
    minibatches = policy.train_global_batch_size is not None and policy.train_global_batch_size < samples
    passes = int(minibatches or config.grpo.async_grpo.enabled) + int(float(algorithm.get("kl_coef") or 0) > 0)
    mcfg = tree["policy"].get("megatron_cfg") or {}
    ddp = mcfg.get("distributed_data_parallel_config") or {}
    megatron = bool(mcfg.get("enabled"))
    return Workload(
        samples=samples, prompt_tokens=prompt, response_tokens=response, response_max=longest, max_seq=max_seq,
        packing=policy.sequence_packing.enabled, micro_batch_size=policy.train_micro_batch_size, logprob_passes=passes,
        generation=has_generator, max_num_seqs=int(gen.get("max_num_seqs", 256)),
        uniform_lengths=longest == response, one_step_off=config.grpo.async_grpo.enabled, seq_sq_mean=sq_mean,
        engine_process=has_generator and config.generation.engine_in_own_process(config.grpo.async_grpo.enabled),
        dtype_bytes=4 if policy.precision in ("float32", "float64") else 2,
        grad_bytes=4 if (not megatron or ddp.get("grad_reduce_in_fp32", True)) else 2,
        overlap_grad_reduce=bool(ddp.get("overlap_grad_reduce")) if megatron else False,
        graph_pool=megatron and mcfg.get("cuda_graph", "none") != "none",
        compiled=not megatron and bool((tree["policy"].get("dtensor_cfg") or {}).get("compile")),
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
    """The recipe's own layout; with ``offload_trainer_state: auto``, what the run's memory plan decides for it
    (:mod:`rlcore.planning.run_memory`): the trainer's state leaves the GPU while the engine is awake when kept it
    would leave the engine short of KV cache."""
    kept = _search.evaluate(inp.shape, inp.work, inp.recipe_layout, inp.cluster, inp.cal)
    if not inp.release_auto or inp.recipe_layout.releases_state:
        return kept
    released = _search.evaluate(inp.shape, inp.work, inp.recipe_layout.with_release(True), inp.cluster, inp.cal)
    return released if kept.memory.better_released(released.memory) else kept
