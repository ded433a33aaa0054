"""The ``rlcore`` command against the plugins really installed in this environment.

Each test runs the installed console script (or ``python -m rlcore.cli``) in a fresh interpreter.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DISTRIBUTIONS = {
    "rlcore-fsdp2": ("fsdp2 = rlcore_fsdp2.plugin", "training_backend"),
    "rlcore-megatron": ("megatron = rlcore_megatron.plugin", "training_backend"),
    "rlcore-vllm": ("vllm = rlcore_vllm.plugin", "generator"),
    "rlcore-math": ("math = rlcore_math.plugin", "environment"),
}
BUILTIN_ALGORITHMS = ("grpo", "dapo", "gspo", "dr_grpo", "rloo", "reinforce_pp", "sft")
HEAVY_MODULES = ("torch", "vllm", "megatron", "transformers", "ray")
TYPO = "policy.megatron_cfg.tensor_model_parallel_sise"


def test_plugins_json_lists_distributions_and_builtins(run_cli):
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    data = {d["distribution"]: d for d in json.loads(result.stdout)}
    for dist, (entry_point, kind) in PLUGIN_DISTRIBUTIONS.items():
        assert dist in data, f"{dist} is not listed: {sorted(data)}"
        assert data[dist]["version"] == "0.1.0"
        assert data[dist]["entry_points"] == [entry_point]
        assert data[dist]["provides"].get(kind), f"{dist} provides no {kind}: {data[dist]['provides']}"
    core = data["rlcore"]
    assert core["entry_points"] == ["builtin = rlcore.builtin"]
    algorithms = {a["name"]: a for a in core["provides"]["algorithm"]}
    assert set(BUILTIN_ALGORITHMS) <= set(algorithms)
    assert all(a["section"] == "algorithm" and a["config"] for a in algorithms.values())
    assert {"jsonl", "tensorboard"} <= {x["name"] for x in core["provides"]["logger"]}
    backends = {b["name"]: b for d in data.values() for b in d["provides"].get("training_backend", [])}
    assert backends["megatron"]["section"] == "policy.megatron_cfg"
    assert backends["fsdp2"]["section"] == "policy.dtensor_cfg"
    # Capabilities are plain data all the way through JSON.
    assert "cpu" in backends["megatron"]["capabilities"]["devices"]


def test_plugins_listing_is_fast_and_imports_nothing_heavy(run_python):
    code = f"""
        import json, sys, time, io, contextlib
        start = time.perf_counter()
        from rlcore.cli.commands import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["plugins", "--json"])
        elapsed = time.perf_counter() - start
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY_MODULES!r})
        print(json.dumps({{"rc": rc, "elapsed": elapsed, "heavy": heavy, "n": len(json.loads(out.getvalue()))}}))
    """
    report = json.loads(run_python(code).stdout.strip().splitlines()[-1])
    assert report["rc"] == 0 and report["n"] >= 5
    assert report["heavy"] == [], f"listing plugins imported {report['heavy'][:10]}"


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on(run_python):
    """What ``rlcore`` installs before it runs a command: a run that seems hung shows where it waits."""
    code = """
        import os, signal, threading
        from rlcore.cli.commands import install_stack_dump
        install_stack_dump()
        started, parked = threading.Event(), threading.Event()
        def waiting_in_a_helper_thread():
            started.set()
            parked.wait(30)
        helper = threading.Thread(target=waiting_in_a_helper_thread)
        helper.start()
        started.wait(30)
        os.kill(os.getpid(), signal.SIGUSR1)
        parked.set(); helper.join()
        print("still running")
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "still running"
    assert "most recent call first" in result.stderr
    assert "waiting_in_a_helper_thread" in result.stderr  # the other thread's stack too


def test_a_finished_run_whose_process_does_not_exit_is_ended_with_its_status(run_python):
    """A non-daemon thread that never returns would keep the interpreter from exiting; the watchdog
    that ``rlcore run`` starts after the summary prints that thread's stack and exits with the status."""
    code = """
        import threading
        from rlcore.cli.commands import start_exit_watchdog
        def a_thread_that_never_returns():
            threading.Event().wait()
        threading.Thread(target=a_thread_that_never_returns).start()
        start_exit_watchdog(0.5, 143)
        print("main returned", flush=True)
    """
    start = time.perf_counter()
    result = run_python(code)
    assert result.returncode == 143, result.stderr
    assert time.perf_counter() - start < 60
    assert result.stdout.strip() == "main returned"
    assert "did not exit within 0.5s (cluster.exit_timeout_s)" in result.stderr
    assert "a_thread_that_never_returns" in result.stderr


def test_a_failed_run_whose_process_does_not_exit_is_ended_too(run_python, recipe):
    """The recipe's model does not exist, so the run fails once it has begun; a thread that never
    returns would then keep the process: `rlcore run` ends it with the failure's status."""
    result = run_python(f"""
        import sys, threading
        def a_thread_that_never_returns():
            threading.Event().wait()
        threading.Thread(target=a_thread_that_never_returns).start()
        sys.argv = ["rlcore", "run", {str(recipe)!r}, "cluster.exit_timeout_s=1"]
        from rlcore.cli.commands import main
        sys.exit(main())
    """)
    assert result.returncode in (1, 2), result.stderr[-3000:]
    assert "did not exit within 1s (cluster.exit_timeout_s)" in result.stderr
    assert f"the run has ended (status {result.returncode})" in result.stderr


def test_the_exit_watchdog_leaves_a_process_that_exits_alone(run_python):
    result = run_python("""
        from rlcore.cli.commands import start_exit_watchdog
        start_exit_watchdog(30.0, 7)
        print("done")
    """)
    assert result.returncode == 0, result.stderr
    assert "did not exit" not in result.stderr


def test_plugins_table_for_people(run_cli):
    result = run_cli("plugins")
    assert result.returncode == 0, result.stderr
    for word in ("rlcore-megatron", "megatron", "rlcore-math", "grpo", "jsonl"):
        assert word in result.stdout


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "policy": {"model_name": str(tmp_path / "no-such-model"), "megatron_cfg": {"enabled": True}},
        "algorithm": {"name": "grpo"},
        "train": {"max_num_steps": 3},
        "logger": {"log_dir": str(tmp_path / "runs")},
    }))
    return path


def test_config_prints_resolved_config(run_cli, recipe):
    result = run_cli("config", str(recipe), "train.max_num_steps=7", "policy.megatron_cfg.tensor_model_parallel_size=2",
                     "algorithm.kl_coef=0.05", "--json")
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["train"]["max_num_steps"] == 7
    assert resolved["grpo"]["num_generations_per_prompt"] == 8  # defaults are filled in
    assert resolved["policy"]["megatron_cfg"]["enabled"] is True
    assert resolved["policy"]["megatron_cfg"]["tensor_model_parallel_size"] == 2
    assert resolved["algorithm"]["name"] == "grpo" and resolved["algorithm"]["kl_coef"] == 0.05
    assert "sections" not in resolved  # plugin sections appear at their own paths
    # The YAML form for people says the same.
    result = run_cli("config", str(recipe), "train.max_num_steps=7", "policy.megatron_cfg.tensor_model_parallel_size=2",
                     "algorithm.kl_coef=0.05")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == resolved


def test_config_rejects_bad_override(run_cli, recipe):
    result = run_cli("config", str(recipe), "train.max_num_steps=lots")
    assert result.returncode == 2
    assert "config key 'train.max_num_steps': expected an integer, got 'lots'" in result.stderr
    assert result.stdout == ""


def test_run_with_misspelled_key_fails_before_any_worker(run_python, recipe, tmp_path):
    code = f"""
        import json, sys
        from rlcore.cli.commands import main
        rc = main(["run", {str(recipe)!r}, "{TYPO}=2"])
        started = sorted(m for m in sys.modules if m.startswith("rlcore.controller") or m.split(".")[0] in {HEAVY_MODULES!r})
        print(json.dumps({{"rc": rc, "started": started}}))
    """
    result = run_python(code)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rc"] == 2
    assert report["started"] == [], f"a config error must stop the run before {report['started'][:5]}"
    assert f"config key '{TYPO}': unknown key; did you mean 'policy.megatron_cfg.tensor_model_parallel_size'?" in result.stderr
    assert not (tmp_path / "runs").exists()


def recipes_to_check() -> list[Path]:
    """Every recipe the repository ships (relative log dirs land in the test's cwd)."""
    return sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("shipped", [None] + recipes_to_check(), ids=lambda p: "tmp-recipe" if p is None else p.name)
def test_run_script_exits_2_naming_the_key(run_cli, recipe, shipped, tmp_path):
    path = recipe if shipped is None else shipped
    result = run_cli("run", str(path), f"{TYPO}=2", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert TYPO in result.stderr and "did you mean 'policy.megatron_cfg.tensor_model_parallel_size'" in result.stderr
    assert not (tmp_path / "runs").exists()  # no run directory: nothing started


@pytest.mark.parametrize("shipped", recipes_to_check(), ids=lambda p: p.name)
def test_shipped_recipes_validate(run_cli, shipped):
    result = run_cli("config", str(shipped), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["policy"]["model_name"]


def test_doctor_reports_versions(run_cli):
    import importlib.metadata as md

    result = run_cli("doctor", "--json")
    report = json.loads(result.stdout)
    for dist in ("torch", "transformers", "megatron-core", "rlcore"):
        assert report["versions"][dist] == md.version(dist)
    assert report["python"].count(".") == 2
    assert set(report["cuda"]) >= {"available", "version", "devices"}
    assert report["stack"] in ("cpu", "cuda")
    te = report["transformer_engine"]
    assert set(te) == {"version", "loads", "error", "cublaslt"} and te["loads"] == (te["error"] is None)
    if report["versions"]["transformer-engine"] is None:
        assert te == {"version": None, "loads": False, "error": "not installed", "cublaslt": None}
    # Exit status says whether the combination is supported, with a fix for each problem.
    assert result.returncode == (0 if report["supported"] else 1)
    assert all(p["fix"] for p in report["problems"])
    # This environment is the one `make install` builds, a supported stack.
    assert report["supported"], report["problems"]



def test_doctor_table_for_people(capsys):
    from rlcore.cli.commands import main

    assert main(["doctor"]) == 0  # in-process: torch is already imported by other tests
    out = capsys.readouterr().out
    assert "torch" in out and "megatron-core" in out and "This combination is supported." in out


def test_usage_errors(run_cli):
    assert run_cli().returncode == 2
    assert run_cli("fly").returncode == 2
    result = run_cli("config", "/nonexistent/recipe.yaml")
    assert result.returncode == 2 and "recipe not found" in result.stderr


def test_core_readme_examples_run(run_python):
    import re

    readme = (REPO / "core" / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) >= 2
    outputs = []
    for block in blocks:
        result = run_python(block)
        assert result.returncode == 0, f"core/README.md example failed:\n{block}\n{result.stderr}"
        outputs.append(result.stdout)
    assert "reward=0.0" in outputs[0] and "did you mean 'env.exact.strip'" in outputs[0]
    counts = outputs[1].strip()
    one, many = re.findall(r"\((\d+), (-?[\d.e-]+)\)", counts)
    assert one[0] == "1" and int(many[0]) > 1 and one[1] == many[1], counts


def test_overrides_after_an_option_join_the_others_in_order(recipe, capsys):
    """``rlcore config RECIPE --json a=1 b=2``: argparse would end the overrides at ``--json`` and refuse the rest."""
    from rlcore.cli.commands import parse

    args = parse(["config", str(recipe), "train.max_num_steps=7", "--json", "train.max_num_steps=9", "algorithm.kl_coef=0.05"])
    assert args.json and args.overrides == ["train.max_num_steps=7", "train.max_num_steps=9", "algorithm.kl_coef=0.05"]
    args = parse(["plan", str(recipe), "--gpus", "1", "train.seed=2", "--gpu", "h100"])
    assert (args.gpus, args.gpu, args.overrides) == (1, "h100", ["train.seed=2"])
    with pytest.raises(SystemExit):  # anything else left over is still an error
        parse(["config", str(recipe), "--json", "stray"])
    assert "unrecognized arguments: stray" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a command without overrides takes none
        parse(["doctor", "--json", "train.seed=2"])
    assert "unrecognized arguments: train.seed=2" in capsys.readouterr().err
