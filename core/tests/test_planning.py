"""The planner (rlcore.planning): held to the measured GPU rows, its search and its command.

The rows test reads ``benchmarks/results.jsonl`` (the rows :mod:`rlcore.planning.fit` names: peak memory
of every H200 training-benchmark row, the phases of the synchronous GRPO steps, the decode steps of vLLM
alone) and holds each prediction of the shipped calibration to it: peak memory within 15%, each phase
within 30%.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.cli.commands import main
from rlcore.config import ConfigError
from rlcore.loading.loader import load_config, to_dict
from rlcore.planning import fit, plan
from rlcore.planning.calibration import load_calibration
from rlcore.planning.shapes import resolve_shape

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results.jsonl"
RECIPE_8B = ROOT / "recipes" / "grpo_math_8B_megatron.yaml"
RECIPE_MOE = ROOT / "recipes" / "grpo_qwen3_30BA3B_megatron.yaml"
TOLERANCE = {"peak_mem_gib": 0.15}  # memory; every phase and the decode step: 0.30


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_CALIBRATION", str(tmp_path / "none.json"))  # no user file
    return load_calibration("h200")


@pytest.mark.skipif(not RESULTS.is_file(), reason="benchmarks/results.jsonl is not in this checkout")
def test_predictions_hold_against_measured_gpu_rows(shipped):
    cases = fit.cases(RESULTS)
    checked = fit.errors(cases, shipped)
    counts: dict[str, int] = {}
    misses = []
    for case, quantity, predicted, measured in checked:
        counts[quantity] = counts.get(quantity, 0) + 1
        if abs(predicted / measured - 1) > TOLERANCE.get(quantity, 0.30):
            misses.append(f"row {case.row} {case.variant} {quantity}: predicted {predicted:.3f}, measured {measured:.3f}")
    assert not misses, "\n".join(misses)
    # what the rows cover (so that the test cannot pass on nothing)
    assert counts["peak_mem_gib"] >= 40 and counts["train_s"] >= 60 and counts["decode_step_ms"] >= 10
    assert min(counts[q] for q in ("refit_s", "generation_s", "logprobs_s", "offload_s")) >= 5
    assert {c.shape.moe for c in cases if "peak_mem_gib" in c.measured} == {False, True}
    assert {c.layout.backend for c in cases if "train_s" in c.measured} == {"megatron", "fsdp2"}


def test_shapes_count_parameters_as_published():
    assert resolve_shape("meta-llama/Llama-3.1-8B-Instruct").total_params == pytest.approx(8.03e9, rel=0.005)
    assert resolve_shape("unsloth/Llama-3.2-1B").total_params == pytest.approx(1.236e9, rel=0.005)
    moe = resolve_shape("Qwen/Qwen3-30B-A3B")
    assert moe.total_params == pytest.approx(30.53e9, rel=0.005)
    # "3.3B activated" counts the input embedding too, which is a lookup, not a GEMM
    assert moe.active_matmul_params + moe.vocab * moe.hidden == pytest.approx(3.3e9, rel=0.03)
    assert resolve_shape("", "qwen3moe", 8).total_params == pytest.approx(5.61e9, rel=0.005)  # benchmarks/moe_shapes.py


def test_shape_from_a_local_directory_and_unknown_names(tiny_model_dir):
    shape = resolve_shape(str(tiny_model_dir))
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert (shape.hidden, shape.layers, shape.vocab) == (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"])
    with pytest.raises(ConfigError, match="policy.model_name"):
        resolve_shape("someone/unknown-model-7b")


def test_recipe_8b_plan_ranks_fitting_layouts_and_checks_the_recipe(shipped):
    inp = plan.inputs(load_config(RECIPE_8B), gpus=8, calibration=shipped)
    ranked = plan.plan(inp)
    fitting = [e for e in ranked if e.fits]
    assert fitting and fitting == sorted(fitting, key=lambda e: e.step_s)
    best = fitting[0]
    assert best.memory.peak_gib <= best.memory.limit_gib
    assert set(best.phases) == {"generation", "refit", "logprobs", "training", "offload"}
    assert all(v >= 0 for v in best.phases.values())
    assert plan.evaluate_recipe(inp).fits  # NeMo-RL's layout of this recipe runs on 8 GPUs


def test_explicit_keys_bind_the_search(shipped):
    config = load_config(RECIPE_8B, ["policy.megatron_cfg.layout=auto", "policy.megatron_cfg.tensor_model_parallel_size=4"])
    inp = plan.inputs(config, gpus=8, calibration=shipped)
    assert inp.fixed["tp"] == 4 and inp.fixed["sp"] is True  # the recipe sets sequence_parallel too
    ranked = plan.plan(inp)
    assert ranked and all(e.layout.tp == 4 and e.layout.sp for e in ranked)
    manual = plan.inputs(load_config(RECIPE_8B), gpus=8, calibration=shipped)
    assert manual.fixed == {}  # a manual section binds nothing: the plan shows every layout beside the recipe's
    assert "explicit_keys" not in to_dict(config)["policy"]["megatron_cfg"]


def test_a_model_too_large_for_the_gpus_says_why(shipped):
    one_gpu = ["policy.megatron_cfg.tensor_model_parallel_size=1", "policy.megatron_cfg.sequence_parallel=false"]
    inp = plan.inputs(load_config(RECIPE_8B, one_gpu), gpus=1, gpu_name="l40s", calibration=load_calibration("l40s"))
    ranked = plan.plan(inp)
    assert ranked and not any(e.fits for e in ranked)
    assert "GiB >" in ranked[0].memory.problem and "largest" in ranked[0].memory.problem


def test_moe_recipe_on_64_gpus_over_8_nodes(shipped):
    from rlcore.planning.search import evaluate

    inp = plan.inputs(load_config(RECIPE_MOE), gpus=64, nodes=8, calibration=shipped)
    fitting = [e for e in plan.plan(inp) if e.fits]
    assert fitting
    # the same layout with its expert all-to-all inside a node (EP 8) and across nodes (EP 16)
    base = fitting[0].layout.with_(tp=1, sp=False, pp=1, cp=1, etp=1)
    inside, across = (evaluate(inp.shape, inp.work, base.with_(ep=ep), inp.cluster, shipped) for ep in (8, 16))
    assert across.phases["training"] > inside.phases["training"]
    assert across.memory.train_parts["weights"] < inside.memory.train_parts["weights"]


def test_plan_command_json(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_CALIBRATION", str(tmp_path / "none.json"))
    assert main(["plan", str(RECIPE_8B), "--gpus", "8", "--json", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpus"] == 8 and data["model"] == "llama-3.1-8b"
    first = data["layouts"][0]
    assert first["fits"] and first["largest_part"] in first["memory_gib"]
    assert {"weights", "gradients", "optimizer", "activations", "logits", "comm_buffers"} <= set(first["training_memory_gib"])
    if first["peak_phase"] == "generation":
        assert {"engine_weights", "kv_cache"} <= set(first["memory_gib"])
    assert main(["plan", str(RECIPE_8B), "--gpus", "8", "--top", "2"]) == 0
    assert "rlcore plan" in capsys.readouterr().out


def test_user_calibration_file_wins_and_unknown_keys_are_named(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setenv("RLCORE_CALIBRATION", str(path))
    path.write_text(json.dumps({"h200": {"decode_host_ms": 1.5}}))
    cal = load_calibration("h200")
    assert cal.decode_host_ms == 1.5 and cal.source == str(path)
    assert load_calibration("h100").decode_host_ms != 1.5  # another GPU's entry is absent: shipped values
    path.write_text(json.dumps({"h200": {"decode_host_sec": 1.5}}))
    with pytest.raises(ConfigError, match="decode_host_sec"):
        load_calibration("h200")


def test_run_time_choice_keeps_the_recipes_engine_share(shipped, monkeypatch):
    """``layout: auto`` plans the trainer beside the engine share the recipe gives vLLM."""
    import yaml

    from rlcore.loading.loader import build_config
    from rlcore.planning import hardware, runtime

    monkeypatch.setattr(runtime, "device_gpu", lambda device: hardware.GPUS["h200"])
    data = yaml.safe_load(RECIPE_8B.read_text())
    data["policy"]["megatron_cfg"] = {"enabled": True, "layout": "auto"}  # every size left to the planner
    shape = resolve_shape("meta-llama/Llama-3.1-8B")
    hf = {"model_type": "llama", "hidden_size": shape.hidden, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
          "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "intermediate_size": shape.ffn,
          "vocab_size": shape.vocab}
    data["policy"]["generation"]["gpu_memory_utilization"] = 0.3
    best, runner_up = runtime.choose(build_config(data), hf, 8, "cuda")
    assert best.fits and best.layout.gen_memory_fraction == pytest.approx(0.3, abs=0.02)
    assert runner_up is not None and runner_up.step_s >= best.step_s
    # beside an engine taking 85% of each GPU no trainer layout of 8 ranks keeps its state: the run stops, saying so
    data["policy"]["generation"]["gpu_memory_utilization"] = 0.85
    with pytest.raises(ConfigError, match="policy.megatron_cfg.layout.*gpu_memory_utilization 0.85"):
        runtime.choose(build_config(data), hf, 8, "cuda")
