"""The planner on measured runs no calibration used (``rlcore.planning.fit.HELD_OUT``): each GRPO row is planned
from its benchmark configuration (``benchmarks/bench_grpo_step.py``: the recipe and the configuration's
overrides, with the row's own ``[key=value]`` settings) and the response lengths the row records, with the
shipped calibration of the row's GPU, as ``rlcore plan`` would plan it. The step must come within 20% and each
phase within 30%; the 10-layer MoE slice's peak memory within 5% (it is the edge of one H200).

What is not compared, and why: the multi-turn row's generation (and so its step) is mostly the environment's
simulated tool latency, which the planner does not model (docs/guides/planning.md); FP8 rollouts' generation (the
planner refuses FP8); a logprob phase under 0.05 s is a step that ran no logprob pass; a row of one step
(``summary after 0``), whose means include the first step's one-time work, is compared for memory only.

Before any GPU time: each configuration the GPU calls run with no memory key (``benchmarks/gpu/fits.sh``) is planned
to fit an 80 GB and a 141 GB card at the benchmark's own batch and lengths, the trainer's state kept on the GPU.

Known misses (:data:`KNOWN_MISSES`, each asserted to be still outside its bound, so a fix shows here): the H200
PPO rows' refit, whose weight transfer ran at 61 GB/s where the H200 rows the refit rate is fitted to (earlier
commits) moved weights at 15-45 GB/s; the tool-calling agent's refit (0.40-0.47 s against 0.24 planned; the native tool
path's, 0.29-0.31 s, is within bounds) and the async-engine multi-turn rows' (0.33-0.36 s against 0.22), and the
generation and step of the agent's first row, which predates the agent path's critical-path
metrics and so is planned at its mean length with no decode tail (its later row is within bounds); the generation
and refit of the first run in each of two calls that measured the PPO configurations against their hand-set
settings (the host-bound engine's spread: the same configurations' other runs on that machine are within bounds); the 0.5B Megatron
configuration measured again on other hosts. Its step is host-bound: its generation takes as long as the 1.2B
model's and its training, 2.75 s in the fitted row, took 3.53 and 4.18-4.23 s in later calls while the 1.2B
model's stayed at 3.9 s; one call's allocator pair (4.18 and 4.23 s) shows the allocator is not the cause.

Memory (``memory/<phase>_device_gib``, NVML's peak over every process, against the run's own memory plan with the
engine share and release it ran with, within 10%), on the held-out rows and the H100 rows the fit reads for their
time alone (no calibration reads an H100 row's memory): the engine-awake phase (refit and generation) on every row;
training misses low on FSDP2 (-16%, compiled or not; -13% with a PPO critic), the graphed Megatron path (-10%) and Megatron's 0.5B and 3B
LoRA rows (-14%, -10%), whose allocators keep blocks cached between micro-batches of different lengths that the
planner, counting tensors, does not price; under that allocator the plan is 12% short of the multi-turn row's refit
peak. A row run with torch's expandable segments (``allocator_conf``) has no known miss by configuration: it measures
the plan's tensors without that cache. An engine in a process of its own (the async engine: tool calls, the agent,
multi-turn) keeps that process's CUDA context and workspace on the GPU while it sleeps, which the plan counts
(``fixed_gib`` again, beside ``engine_asleep_gib``): the multi-turn rows' training, 46.2 GiB, against 41.9 (-9%),
the device holding 3.7 GiB above the trainer's own (torch's) peak on each such row where the plan counts 2.0. The
probe's sequences are priced at the row's lengths (the run's plan takes the limit).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from rlcore.loading.loader import build_config, to_dict
from rlcore.planning import fit, plan
from rlcore.planning.calibration import load_calibration
from rlcore.planning.hardware import GPUS
from rlcore.planning.memory import refit_transient_gib
from rlcore.planning.run_memory import plan_run_memory, with_refit
from rlcore.planning.bench_shapes import bench_shape

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results.jsonl"
PHASES = {"train_s": "training", "refit_s": "refit", "generation_s": "generation", "logprobs_s": "logprobs",
          "offload_s": "offload", "values_s": "values", "critic_train_s": "critic"}
MACHINE_GPU = {machine: name for name, machine in fit.MACHINES.items()}
# the environment's time, and FP8 rollouts (see above)
NOT_MODELLED = {"llama1b-multiturn-async": ("generation_s", "step_s"), "llama1b-megatron-fp8gen": ("generation_s", "step_s")}
# keyed by (configuration, GPU) for every row of it, or by a row's run id for that row alone
KNOWN_MISSES = {("llama1b-fsdp2-ppo", "h200"): ("refit_s",), ("llama1b-megatron-ppo", "h200"): ("refit_s",),
                ("llama1b-tool-agent", "h100"): ("refit_s",), ("llama1b-multiturn-async", "h100"): ("refit_s",),
                "20261207T065511-9c4919": ("generation_s", "step_s"),  # the agent's row with no longest trajectory
                # the 0.5B model's host-bound step, on hosts slower than the fitted row's
                "20261207T071311-1e5a75": ("train_s", "refit_s"),
                "20261207T090150-07c710": ("train_s", "refit_s", "step_s"),
                "20261207T090445-77a5aa": ("train_s", "generation_s", "step_s"),
                # the first run of each PPO pair's call: its generation and refit slower than the same configuration's
                # other runs on that machine (12.4 and 12.6 s against 7.3-10.7 s; refit 0.33-0.35 s against 0.24-0.26)
                "20261207T215322-235228": ("refit_s", "generation_s"),
                "20261207T220119-05283a": ("refit_s", "generation_s")}
# Per-phase device memory (``memory/<phase>_device_gib``) held to 10%: the known misses (see the module's text)
MEMORY_KNOWN_MISSES = {"llama1b-fsdp2-compile": ("training",), "llama1b-megatron-cuda-graph": ("training",),
                       "llama1b-multiturn-async": ("generation",), "llama3b-megatron-lora": ("training",),
                       "llama1b-fsdp2": ("training",), "llama0.5b-fsdp2": ("training",), "llama0.5b-megatron": ("training",),
                       "llama1b-fsdp2-ppo": ("training",)}

pytestmark = pytest.mark.skipif(not RESULTS.is_file(), reason="benchmarks/results.jsonl is not in this checkout")


def _rows() -> dict[tuple, tuple[int, dict]]:
    out = {}
    for number, line in enumerate(RESULTS.read_text().splitlines(), 1):
        r = json.loads(line)
        out[fit.row_key(r)] = (number, r)
    return out


def _set(tree: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = {**tree[last], **value} if isinstance(value, dict) and isinstance(tree.get(last), dict) else value


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_grpo_step
    finally:
        sys.path.pop(0)
    return bench_grpo_step


def _row_run(r: dict, *, as_ran: bool = False):
    """(config, model shape, GPU name, mean and longest response) of the row's run: the benchmark's recipe for its
    configuration (and shape) on one GPU. ``as_ran``: with the engine's share and the trainer's release the run's
    memory plan of that time chose (the row's ``memory_plan/engine_fraction`` and ``memory_plan/offload_trainer_state``)."""
    bench = _bench()
    name = r["variant"].split(" [")[0]
    # the row's [key=value] settings, less torch's allocator settings (an environment variable, not a key)
    settings = [(k, v) for k, v in re.findall(r"\[([\w.]+)=([^\]]+)\]", r["variant"]) if k != "PYTORCH_CUDA_ALLOC_CONF"]
    shape, backend, overrides = bench.CONFIGS[name]
    args = type("Args", (), {"max_new_tokens": r["max_new_tokens"], "mb_tokens": 8192, "prompts": 32, "kl_coef": 0.0,
                             "samples": r["samples"] // 32, "generator": "vllm", "steps": 2, "warmup": 1, "tiny": False})
    tree = bench.recipe(Path("model"), backend, Path("run"), args, True)
    recipe_env = tree["env"]
    for key, value in overrides.items():
        _set(tree, key, value)
    bench.size_for_turns(tree, args)  # the length limit and micro-batches the run had for its turns
    # the planner reads no environment (a benchmark's own is not registered here)
    tree["env"] = recipe_env
    for key, value in settings:
        _set(tree, key, json.loads(value))
    if as_ran:
        # the row keeps the share its plan chose to 3 decimals: rounded up, a share that filled the GPU would not fit
        _set(tree, "policy.generation.gpu_memory_utilization", r["memory_plan/engine_fraction"] - 0.0005)
        _set(tree, "policy.generation.colocated.offload_trainer_state", bool(r["memory_plan/offload_trainer_state"]))
    mean = round(r["tokens_per_sample"])
    longest = round(r.get("rollout/longest_trajectory_model_tokens") or mean)
    tree["policy"]["max_total_sequence_length"] = max(tree["policy"]["max_total_sequence_length"], longest + 64)
    model = fit.grpo_bench_shape(name)
    assert "moe" in name or model == bench_shape(shape), f"{name}: the fit reads another model than the benchmark's {shape}"
    return build_config(tree), model, MACHINE_GPU[r["machine"]], mean, longest


PROMPT_TOKENS = 16  # the benchmark's prompts, tokenized


def plan_row(r: dict):
    """The row's run as ``rlcore plan`` sees it, with the response lengths the row records."""
    config, model, gpu_name, mean, longest = _row_run(r)
    inp = plan.inputs(config, world=1, gpu_name=gpu_name, model=model, prompt_tokens=PROMPT_TOKENS, response_tokens=mean,
                      response_max=longest, calibration=load_calibration(gpu_name, user_file=Path(os.devnull)))
    return plan.evaluate_recipe(inp)


def run_memory_plan(r: dict):
    """The memory plan the row's run makes before it loads (:func:`rlcore.planning.run_memory.plan_run_memory`: its
    lengths at the recipe's limits, the refit's staged chunk and probe pass), with the engine's share and release it
    ran with; and that plan's refit transient (the staged chunk and the probe's logprob pass) with the probe's
    sequences at the row's prompt and mean response, where the run's plan prices them at the length limit (the probe
    takes the step's first sequences, which a run may fill to the limit): the workload that ran, as the time test
    plans it."""
    config, model, gpu_name, mean, _ = _row_run(r, as_ran=True)
    tree = to_dict(config)
    run_plan = plan_run_memory(config, model, GPUS[gpu_name], 1, critic=plan.critic_shape(tree, model) is not None)
    layout, work = plan.recipe_work(config, tree)
    seq = min(config.policy.max_total_sequence_length, PROMPT_TOKENS + mean)
    work = with_refit(work, config, seq)
    return run_plan, refit_transient_gib(model, work, layout, load_calibration(gpu_name, user_file=Path(os.devnull)))


GRPO = sorted(k for k in fit.HELD_OUT if k[0] == "bench_grpo_step")
# a row of one step, whose means include the first step's one-time work (allocations, pinned buffers): memory only
TIMED = [k for k in GRPO if "(summary after 0)" not in _rows()[k][1]["config"]] if RESULTS.is_file() else []


def test_held_out_rows_exist_and_no_calibration_used_them():
    rows = _rows()
    assert set(fit.HELD_OUT) <= set(rows), sorted(set(fit.HELD_OUT) - set(rows))
    shipped = json.loads((ROOT / "core/src/rlcore/planning/data/calibration.json").read_text())
    for gpu_name, entry in shipped.items():
        fitted = {tuple(key) for key in entry["rows"]}
        assert fitted and not fitted & fit.HELD_OUT, gpu_name
        # the shipped rows are the ones the fit reads now: the calibration is reproducible from them
        assert fitted == {fit.row_key(rows_r) for _, rows_r in (rows[k] for k in fitted)}
        assert fitted == {fit.row_key(json.loads(RESULTS.read_text().splitlines()[c.row - 1])) for c in fit.cases(RESULTS, gpu_name)}
    # held out on both GPUs, and PPO on each
    assert {MACHINE_GPU[rows[k][1]["machine"]] for k in GRPO} == {"h100", "h200"}


@pytest.mark.parametrize("key", TIMED, ids=lambda k: f"{k[1].split(' [')[0]}-{k[2][:15]}")
def test_a_held_out_grpo_step_is_predicted_within_bounds(key):
    number, r = _rows()[key]
    est = plan_row(r)
    name = r["variant"].split(" [")[0]
    skip = NOT_MODELLED.get(name, ())
    known = KNOWN_MISSES.get((name, MACHINE_GPU[r["machine"]]), ()) + KNOWN_MISSES.get(r.get("run_id"), ())
    compared, misses = [], []
    for field, phase in PHASES.items():
        measured = r.get(field)
        if field in skip or measured is None or (field == "logprobs_s" and measured < 0.05):
            continue
        compared.append(field)
        predicted = est.phases.get(phase, 0.0)
        if (abs(predicted / measured - 1) > 0.30) != (field in known):
            misses.append(f"{field}: predicted {predicted:.3f} measured {measured:.3f}"
                          + (" (a known miss now within bounds: take it off KNOWN_MISSES)" if field in known else ""))
    if "step_s" not in skip:
        compared.append("step_s")
        if (abs(est.step_s / r["step_s"] - 1) > 0.20) != ("step_s" in known):
            misses.append(f"step_s: predicted {est.step_s:.3f} measured {r['step_s']:.3f}"
                          + (" (a known miss now within bounds: take it off KNOWN_MISSES)" if "step_s" in known else ""))
    assert not misses, f"row {number} {r['variant']} on {r['machine']}: " + "; ".join(misses)
    assert {"train_s", "refit_s"} <= set(compared)  # the test compares something on every row


def test_the_moe_slice_at_the_edge_of_memory():
    key = next(k for k in fit.HELD_OUT if k[0] == "bench_train_megatron")
    number, r = _rows()[key]
    case = fit._train_case(number, r)
    predicted = fit.predict(case, load_calibration("h200", user_file=Path(os.devnull)))
    assert case.shape.layers == 10
    assert predicted["peak_mem_gib"] == pytest.approx(r["peak_mem_gib"], rel=0.05)
    assert predicted["train_s"] == pytest.approx(r["step_s"], rel=0.30)


def _memory_rows() -> list[tuple]:
    """The held-out rows, and the H100 rows the fit reads for time alone (no calibration reads an H100 row's memory)."""
    rows = _rows()
    by_number = {number: r for number, r in rows.values()}
    keys = set(GRPO) | {fit.row_key(by_number[c.row]) for c in fit.cases(RESULTS, "h100")}
    return sorted(k for k in keys if "memory/training_device_gib" in rows[k][1])


MEMORY_ROWS = _memory_rows() if RESULTS.is_file() else []


@pytest.mark.parametrize("key", MEMORY_ROWS, ids=lambda k: f"{k[1].split(' [')[0]}-{k[2][:15]}")
def test_a_held_out_rows_memory_per_phase_is_predicted_within_10_percent(key):
    """The run's own memory plan, with the engine share and release it ran with, against the device's peak in each
    phase. The plan's generation phase is the engine awake: the refit (from the weights' wake-up) and generation, so the
    higher of the two measured peaks. A row of one step measures its first, whose training and generation come before
    the optimizer's first step creates its state (Megatron's Adam moments: 11 GiB at 1.2B): its training is not compared,
    and its engine-awake peak is the refit's, which follows that step."""
    number, r = _rows()[key]
    run_plan, refit_at_row_lengths = run_memory_plan(r)
    mem = run_plan.memory
    gen = sum(mem.gen_parts.values())
    if "refit" in mem.gen_parts:
        gen += refit_at_row_lengths - mem.gen_parts["refit"]
    predicted = {"training": sum(mem.train_parts.values()), "generation": gen}
    if "(summary after 0)" in r["config"]:  # one step, its first
        measured_by_phase = {"generation": r.get("memory/refit_device_gib") or r["memory/generation_device_gib"]}
    else:
        measured_by_phase = {"training": r["memory/training_device_gib"],
                             "generation": max(r["memory/generation_device_gib"], r.get("memory/refit_device_gib") or 0.0)}
    # a known miss is the caching allocator's; a row run with expandable segments has none
    known = () if r.get("allocator_conf") else MEMORY_KNOWN_MISSES.get(r["variant"].split(" [")[0], ())
    misses = []
    for phase in measured_by_phase:
        measured = measured_by_phase[phase]
        if (abs(predicted[phase] / measured - 1) > 0.10) != (phase in known):
            misses.append(f"{phase}: predicted {predicted[phase]:.1f} GiB measured {measured:.1f} GiB"
                          + (" (a known miss now within bounds: take it off MEMORY_KNOWN_MISSES)" if phase in known else ""))
    assert not misses, f"row {number} {r['variant']} on {r['machine']}: " + "; ".join(misses)


def test_memory_rows_cover_both_backends_and_a_fit():
    names = {_rows()[k][1]["variant"].split(" [")[0] for k in MEMORY_ROWS}
    assert {"llama8b-megatron-lora", "llama8b-fsdp2-lora", "llama3b-megatron-lora", "llama3b-fsdp2-lora"} <= names
    assert any(n not in MEMORY_KNOWN_MISSES for n in names)


def _device_list() -> list[str]:
    """The configurations the GPU calls run with no memory key (benchmarks/gpu/fits.sh: ``FITS`` and the held-out
    shapes)."""
    text = (ROOT / "benchmarks" / "gpu" / "fits.sh").read_text()
    return [name for var in ("FITS", "HELD_OUT_SHAPES")
            for name in re.search(rf"^{var}=\(([^)]*)\)", text, re.M).group(1).split()]


@pytest.mark.parametrize("gpu_name", ["h100", "h200"])
@pytest.mark.parametrize("name", _device_list())
def test_every_configuration_the_device_runs_is_planned_to_fit_both_cards_with_no_memory_key(name, gpu_name):
    """What a run's memory plan decides before it loads, for each configuration fits.sh runs on a GPU, at the benchmark's
    own batch and lengths: it fits the 80 GB and the 141 GB card, with the KV cache its step needs and the trainer's
    state kept on the GPU (so no configuration of the list is refused at start, and none pays the release)."""
    as_benchmarked = {"variant": name, "max_new_tokens": 1024, "samples": 256, "machine": fit.MACHINES[gpu_name],
                      "tokens_per_sample": 1024}
    config, model, _, _, _ = _row_run(as_benchmarked)
    run_plan = plan_run_memory(config, model, GPUS[gpu_name], 1, critic=plan.critic_shape(to_dict(config), model) is not None)
    assert run_plan.memory.fits and not run_plan.memory.kv_short, (name, gpu_name, run_plan.memory.problem)
    assert not run_plan.offload_trainer_state, (name, gpu_name, run_plan.engine_fraction)
    assert 0.05 < run_plan.engine_fraction < 0.95, (name, gpu_name, run_plan.engine_fraction)


def test_the_device_list_holds_every_single_gpu_llama1b_configuration_of_the_fits_table():
    assert set(_device_list()) >= {"llama1b-megatron", "llama1b-megatron-cuda-graph", "llama1b-fsdp2", "llama1b-fsdp2-compile",
                                   "llama1b-megatron-ppo", "llama1b-fsdp2-ppo", "llama1b-multiturn-async",
                                   "llama1b-multiturn-sync-barrier", "llama1b-tool-async", "llama1b-tool-agent",
                                   "llama1b-megatron-fp8gen"}
