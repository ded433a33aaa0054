"""The cluster launchers in examples/launch, checked without a cluster.

``slurm.sbatch`` must parse (``bash -n``) and build its ``rlcore run`` arguments from Slurm's
variables; the KubeRay ``RayJob`` must carry the fields KubeRay reads, keep the dashboard on
loopback, and ask for as many nodes and GPUs as its pod groups hold. Both start Ray's nodes with the
settings the two-node test's cluster has (``test_multinode_ray.LAUNCHER_ENV``, no monitor), whose
listener audit therefore speaks for them. The ``rlcore run`` line of
each must resolve with ``rlcore config``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from test_multinode_ray import LAUNCHER_ENV

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "examples" / "launch"
RLCORE = [sys.executable, "-m", "rlcore.cli"]


def _resolve(args: list[str]) -> dict:
    """The config ``rlcore config <args>`` prints, parsed; fails with its error otherwise."""
    done = subprocess.run([*RLCORE, "config", *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return yaml.safe_load(done.stdout)


def test_the_slurm_script_parses_and_its_run_line_resolves_from_slurms_variables():
    script = LAUNCH / "slurm.sbatch"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    text = script.read_text()
    # What the two-node test's cluster starts with, so that its listener audit holds for the launchers.
    head_line = next(line for line in text.splitlines() if "ray start --head" in line)
    assert "--include-dashboard=false" in head_line and "--no-monitor" in head_line, head_line
    for name, value in LAUNCHER_ENV.items():
        assert f"\nexport {name}={value}\n" in text, name
    (run_line,) = [line for line in text.splitlines() if line.startswith("RUN_ARGS=(")]
    # The script's own line, run by bash with the values Slurm and the script would give it.
    probe = (f'set -u; RECIPE=recipes/grpo_arith3_gpu.yaml NUM_NODES=3 GPUS_PER_NODE=4 RAY_ADDRESS=10.1.2.3:6379; '
             f'set -- train.max_num_steps=7; {run_line}; printf "%s\\0" "${{RUN_ARGS[@]}}"')
    built = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    assert built[0] == "recipes/grpo_arith3_gpu.yaml"
    config = _resolve(built)
    assert config["cluster"]["num_nodes"] == 3 and config["cluster"]["gpus_per_node"] == 4
    assert config["cluster"]["ray_address"] == "10.1.2.3:6379" and config["train"]["max_num_steps"] == 7
    for variable in ("SLURM_JOB_NUM_NODES", "SLURM_GPUS_ON_NODE"):  # where the two numbers come from
        assert f"${{{variable}" in text, variable


def test_the_rayjob_has_what_kuberay_needs_and_its_entrypoint_resolves():
    job = yaml.safe_load((LAUNCH / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    head, workers = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    groups = [head["template"]["spec"], *[group["template"]["spec"] for group in workers]]
    for pod in groups:
        assert pod["containers"] and all(c["name"] and c["image"] for c in pod["containers"]), pod
    for group in workers:
        assert group["groupName"] and group["replicas"] >= 1 and "rayStartParams" in group
    # The dashboard only on the head pod's loopback; the submitter then must share the pod.
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    # As the two-node test's cluster: no monitor, and every container with the launchers' Ray settings.
    assert head["rayStartParams"]["no-monitor"] == "true"
    for pod in groups:
        env = {item["name"]: item["value"] for item in pod["containers"][0].get("env", [])}
        assert env.items() >= LAUNCHER_ENV.items(), env
    assert spec["submissionMode"] == "SidecarMode" and head["template"]["spec"]["restartPolicy"] == "Never"
    words = shlex.split(spec["entrypoint"])
    assert words[:2] == ["rlcore", "run"], words
    recipe = words[2].replace("/app/", f"{ROOT}/", 1)  # the image holds the repository at /app
    config = _resolve([recipe, *words[3:]])
    gpus = {int(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) for pod in groups}
    assert config["cluster"]["num_nodes"] == 1 + sum(group["replicas"] for group in workers)
    assert gpus == {config["cluster"]["gpus_per_node"]}, gpus
