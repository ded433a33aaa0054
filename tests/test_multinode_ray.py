"""Trainer ranks on two Ray nodes give the same GRPO steps as on one node.

A real Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``: two raylets, each
with its own CPUs and object store, joined to one GCS). One driver process (``rlcore.run``
joining the cluster through ``cluster.ray_address``; the ``hf`` generator in it, on the head
node) runs the same deterministic 2-step recipe twice: 2 FSDP2 ranks placed ``SPREAD`` (one rank
per node; the gloo process group meets at the address rank 0's node reports, weights cross nodes
in the refit), then ``STRICT_PACK`` (both ranks on one node). Every metric but timings must be
equal. A third run asks for more ranks than the cluster has CPUs and must fail before any actor
starts, naming what is missing. The ranks run on two worker nodes; the head (GCS) has no CPUs.

Then a node is lost mid-step: rank 1 is held inside step 2's ``train`` call (the fault plugin's
hang), every listening socket of the run's processes is audited (what listens beyond loopback must
be a documented Ray server or the process group's, bound to the node's address: README, "Run on a
cluster"), and rank 1's node is removed ungracefully (raylet and every process of the node killed).
The run must stop naming the rank, node, call and step; a replacement node joins and the step-1
checkpoint resumes to step 2's metrics of the uninterrupted SPREAD run.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from rlcore.testing.faults import fault_env

pytestmark = pytest.mark.slow

CPUS_PER_NODE = 2
TIMING_PREFIXES = ("timing/", "time/", "refit/seconds", "refit/gb_per_s", "refit/generator_hold_s", "train/seconds", "run_id")


# What the launchers in examples/launch give `ray start`, for the listeners they close: on every
# node RAY_enable_metrics_collection=0 (no Prometheus endpoint in the dashboard agents), on the head
# --include-dashboard=false and --no-monitor (no autoscaler monitor and its metrics port).
LAUNCHER_ENV = {"RAY_enable_metrics_collection": "0"}
LAUNCHER_HEAD_ARGS = {"include_dashboard": False, "no_monitor": True}


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head without CPUs (GCS, the driver's node) and two worker nodes of CPUS_PER_NODE: every
    trainer rank runs on a worker node, so a test may kill any rank's node and keep the GCS. The
    nodes start as the launchers start theirs (LAUNCHER_ENV, LAUNCHER_HEAD_ARGS)."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as env:  # every node's processes, the replacement's too, inherit it
        for name, value in LAUNCHER_ENV.items():
            env.setenv(name, value)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **LAUNCHER_HEAD_ARGS})
        try:
            for _ in range(2):
                cluster.add_node(num_cpus=CPUS_PER_NODE)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            cluster.shutdown()


def _recipe(model_dir: Path, run_dir: Path, address: str) -> dict:
    return {
        "policy": {
            "model_name": str(model_dir), "precision": "float32", "max_total_sequence_length": 48,
            # weight decay moves every weight each step, so a refit that did not arrive fails the probe
            "optimizer": {"lr": 1e-3, "weight_decay": 1.0}, "dtensor_cfg": {"enabled": True},
            "generation": {"backend": "hf", "max_new_tokens": 3, "temperature": 1.0},
        },
        # A random model earns no reward; the KL term to the reference gives step 2 a loss and a gradient.
        "algorithm": {"name": "grpo", "kl_coef": 0.5},
        "data": {"name": "arithmetic", "digits": 1, "num_validation": 8, "num_train": 64},
        "env": {"name": "math", "math": {"executor": "inline"}},
        "train": {"num_prompts_per_step": 4, "max_num_steps": 2, "val_period": 0, "seed": 3, "deterministic": True},
        "grpo": {"num_generations_per_prompt": 4},
        "cluster": {"use_ray": True, "cpu_workers": 2, "ray_address": address, "timeout_s": 120},
        "logger": {"log_dir": str(run_dir), "print_table": False, "plot": False},
        "checkpointing": {"enabled": False},
    }


@pytest.fixture(scope="module")
def runs(two_node_cluster, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tiny_model_dir, tmp / "unused", two_node_cluster.address)))
    code = textwrap.dedent(f"""
        import rlcore
        from rlcore.controller.ray_placement import PlacementError
        if __name__ == "__main__":
            for strategy in ("SPREAD", "STRICT_PACK"):
                rlcore.run(rlcore.load_config({str(path)!r}, overrides=[
                    f"cluster.placement_strategy={{strategy}}", f"logger.log_dir={tmp}/{{strategy}}"]))
            try:
                rlcore.run(rlcore.load_config({str(path)!r}, overrides=["cluster.cpu_workers=5",
                                                                      "cluster.placement_strategy=SPREAD"]))
            except PlacementError as exc:
                print("placement refused:", exc, flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)
    return done, tmp


def _records(run_dir: Path) -> dict[int, dict]:
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES)}
    return records


def test_ranks_on_two_nodes_match_one_node(runs):
    done, tmp = runs
    assert done.returncode == 0, done.stderr[-3000:]
    placed = re.findall(r"trainer: 2 ranks on (\d) node\(s\) \((\w+)\): rank 0 on (\S+) \(node (\w+)\), "
                        r"rank 1 on (\S+) \(node (\w+)\); process group at (\S+):(\d+)", done.stdout)
    assert [(n, strategy) for n, strategy, *_ in placed] == [("2", "SPREAD"), ("1", "STRICT_PACK")], done.stdout[-3000:]
    spread = placed[0]
    assert spread[3] != spread[5]  # two nodes
    assert spread[6] == spread[2] and not spread[6].startswith("127."), spread  # rank 0's node's own address
    a, b = _records(tmp / "SPREAD"), _records(tmp / "STRICT_PACK")
    assert sorted(a) == sorted(b) == [1, 2]
    assert a[2]["train/kl"] > 0 and a[2]["train/grad_norm"] > 0, a[2]  # the numbers compared are not all zero
    for step in (1, 2):
        assert a[step]["refit/bytes"] > 0 and a[step]["refit/probe_max_abs_logprob_diff"] < 1e-4, a[step]
        assert a[step].keys() == b[step].keys()
        for key in a[step]:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_a_placement_the_cluster_cannot_hold_fails_at_once_naming_what_is_missing(runs):
    done, _ = runs
    refused = [line for line in done.stdout.splitlines() if line.startswith("placement refused:")]
    assert len(refused) == 1, done.stdout[-3000:]
    assert "5 trainer ranks need 5 bundles of {CPU 1} (SPREAD)" in refused[0], refused[0]
    assert "3 alive node(s)" in refused[0] and "too few: 1 CPU missing" in refused[0], refused[0]


FAULT_STEP = 2
RUN_RECIPE = textwrap.dedent("""
    import rlcore
    if __name__ == "__main__":
        rlcore.run(rlcore.load_config({path!r}))
""")


class _Driver:
    """A driver subprocess whose output lines are collected as they come."""

    def __init__(self, path: Path, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-c", RUN_RECIPE.format(path=str(path))], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.out):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in the driver's output; stdout: {''.join(self.out)[-3000:]}\n"
                                     f"stderr: {''.join(self.err)[-3000:]}")
            time.sleep(0.2)

    def finish(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        for reader in self._readers:
            reader.join(timeout=5)
        return code


def _listeners(pids) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every listening TCP socket of ``pids``: what
    ``ss -ltnp`` shows for those processes."""
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found += [(pid, proc.name(), c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet") if c.status == "LISTEN"]
        except psutil.Error:
            continue
    return found


def _cluster_processes(cluster) -> dict[int, str]:
    """pid -> Ray process type of every process of the cluster's nodes: GCS, raylets, the head's
    monitor and dashboard, and the agents and workers each raylet starts (``"raylet child"``)."""
    kinds = {}
    for node in [cluster.head_node, *cluster.worker_nodes]:
        for kind, infos in node.all_processes.items():
            for info in infos:
                try:
                    root = psutil.Process(info.process.pid)
                    kinds[root.pid] = kind
                    kinds.update({child.pid: f"{kind} child" for child in root.children(recursive=True)})
                except psutil.Error:
                    continue
    return kinds


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def _is_wildcard(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified


def _roles_of_ray_daemons(cluster) -> dict[tuple[str, int], str]:
    """(process name, port) -> what it is, for the listeners Ray's own daemons open on a node whose
    address is not loopback and that the launchers' settings cannot close (Ray 2.60; README, "Run on
    a cluster", ports). Not among them, so an audit fails if they open: the autoscaler monitor's
    metrics (closed by --no-monitor), the agents' Prometheus endpoints (RAY_enable_metrics_collection=0)
    and the dashboard's HTTP server beyond loopback."""
    from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
    from ray.dashboard.consts import DASHBOARD_METRIC_PORT

    roles = {("gcs_server", int(cluster.address.rsplit(":", 1)[1])): "GCS (between nodes)",
             ("python", DASHBOARD_METRIC_PORT): "dashboard process's Prometheus metrics (head; its HTTP server is off)",
             # an agent may hold Ray's default HTTP port while its node reports another (seen with
             # several clusters on one machine)
             ("ray::DashboardAgent", DEFAULT_DASHBOARD_AGENT_LISTEN_PORT): "dashboard agent HTTP (job/state API)"}
    for node in [cluster.head_node, *cluster.worker_nodes]:
        roles[("raylet", node.node_manager_port)] = "raylet node manager (between nodes)"
        roles[("ray::DashboardAgent", node.metrics_agent_port)] = "dashboard agent gRPC (its node's workers; cannot be closed)"
        roles[("ray::DashboardAgent", node.dashboard_agent_listen_port)] = "dashboard agent HTTP (job/state API)"
        roles[("ray::RuntimeEnvAgent", node.runtime_env_agent_port)] = "runtime env agent (the node's raylet)"
    return roles


def _audit_listeners(cluster, driver_pid: int, trainer_node_ips: set[str], master: tuple[str, int]) -> list[str]:
    """What listens beyond loopback that should not, during a run on the cluster; [] when all is
    as documented in the README ("Run on a cluster", ports).

    Allowed: Ray's daemons at the ports their nodes report (:func:`_roles_of_ray_daemons`) plus the
    raylet's object manager (its one other port); in every Ray worker process (the driver and each
    trainer rank) one wildcard listener, its core worker's gRPC server; in the trainer ranks the
    process group's sockets, bound to the rank's node address, never to every interface: the TCP
    store at the rendezvous address (rank 0) and gloo's pair sockets."""
    processes = _cluster_processes(cluster)
    driver_tree = [driver_pid, *[c.pid for c in psutil.Process(driver_pid).children(recursive=True)]]
    roles = _roles_of_ray_daemons(cluster)
    wrong, wildcard_per_worker, raylet_ports, store_seen = [], {}, {}, False
    for pid, name, ip, port in _listeners([*driver_tree, *processes]):
        if _is_loopback(ip):
            continue
        worker = pid in driver_tree or name.startswith("ray::_TrainerActor")
        if worker and _is_wildcard(ip):
            wildcard_per_worker[pid] = wildcard_per_worker.get(pid, 0) + 1
        elif name.startswith("ray::_TrainerActor") and ip in trainer_node_ips:
            store_seen |= (ip, port) == master
        elif name == "raylet":
            raylet_ports.setdefault(pid, []).append(port)
        elif (name, port) not in roles:
            wrong.append(f"{name} (pid {pid}, {processes.get(pid, 'driver')}) listens on {ip}:{port}")
    wrong += [f"pid {pid} has {n} wildcard listeners (one is its Ray core worker)" for pid, n in wildcard_per_worker.items() if n > 1]
    for pid, ports in raylet_ports.items():  # node manager (reported) and object manager
        if len(ports) > 2 or not any(("raylet", port) in roles for port in ports):
            wrong.append(f"raylet pid {pid} listens on ports {ports}")
    if not store_seen:
        wrong.append(f"no trainer rank listens at the process group's address {master[0]}:{master[1]} (bound to it)")
    if len(wildcard_per_worker) < 3:
        wrong.append(f"expected the driver and both ranks among the Ray workers, saw pids {sorted(wildcard_per_worker)}")
    return wrong


def test_a_node_lost_mid_step_stops_the_run_naming_it_and_the_checkpoint_resumes(two_node_cluster, runs, tiny_model_dir,
                                                                                   tmp_path):
    cluster, (_, spread_tmp) = two_node_cluster, runs
    run_dir = tmp_path / "lost-node"
    recipe = _recipe(tiny_model_dir, run_dir, cluster.address)
    recipe["cluster"]["placement_strategy"] = "SPREAD"
    recipe["checkpointing"] = {"enabled": True, "save_period": 1}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Rank 1 holds step 2's 'train' call open (the fault injection's hang), so the kill lands mid-call.
    driver = _Driver(path, {**env, **fault_env(f"hang:train:{FAULT_STEP}:1")})
    try:
        driver.wait_for("RLCORE_FAULT: trainer rank 1 hangs now", timeout_s=240)
        placed = re.search(r"rank 1 on (\S+) \(node (\w+)\); process group at (\S+):(\d+)", "".join(driver.out))
        assert placed, "".join(driver.out)[-3000:]
        address, node_prefix = placed.group(1), placed.group(2)
        # Mid-step, every process of the run is up: what listens beyond loopback must be documented.
        node_ips = set(re.findall(r"rank \d on (\S+) \(node", "".join(driver.out)))
        assert _audit_listeners(cluster, driver.proc.pid, node_ips, (placed.group(3), int(placed.group(4)))) == []
        node = next(n for n in cluster.worker_nodes if n.node_id.startswith(node_prefix))
        killed_at = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)
        code = driver.finish(timeout_s=120)
        assert time.monotonic() - killed_at < 60, "the lost node was not noticed within a minute"
    finally:
        if driver.proc.poll() is None:
            driver.proc.kill()
    stderr = "".join(driver.err)
    assert code != 0
    assert f"trainer rank 1 (pid " in stderr and f"on node {address} ({node_prefix})" in stderr, stderr[-3000:]
    assert f"died during 'train' at step {FAULT_STEP}" in stderr, stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]
    cluster.add_node(num_cpus=CPUS_PER_NODE)  # a replacement for the lost node
    cluster.wait_for_nodes()
    resumed = _Driver(path, env)
    assert resumed.finish(timeout_s=240) == 0, "".join(resumed.err)[-3000:]
    assert "resumed from" in "".join(resumed.out)
    a, b = _records(spread_tmp / "SPREAD"), _records(run_dir)
    assert sorted(b) == [1, 2]
    for key in a[2]:
        assert a[2][key] == pytest.approx(b[2][key], rel=1e-6, abs=1e-9), key
