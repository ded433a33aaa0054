"""The local Ray instance a one-machine run starts: listening on loopback only, gone with its driver.

Ray's servers (GCS, raylet, workers, agents) bind to loopback only when the node's address is
127.0.0.1, but ``ray.init`` replaces a loopback ``_node_ip_address`` by the machine's address
unless Ray's "local only" mode is on: on macOS and Windows it is, on Linux only while
``ray_constants.ENABLE_RAY_CLUSTER`` is false. That switch is held off for the ``ray.init`` call.

After a ``kill -9`` of the driver, the raylet and GCS die with it but Ray's agents spend up to a
minute trying to tell the dead GCS; :func:`start_reaper` starts a small process that ends the
driver's remaining Ray processes as soon as the driver is gone.

``address="local"``: without it ``ray.init`` joins the latest cluster started on the machine
(``/tmp/ray/ray_current_cluster``) when one is still up, and then refuses the CPU and GPU counts
given here ("When connecting to an existing cluster, num_cpus and num_gpus must not be
provided", as when another run's Ray instance outlived its killed driver). A run that means
to join a cluster names it (``cluster.ray_address`` or ``RAY_ADDRESS``) and never comes here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

LOOPBACK = "127.0.0.1"


def start_local_ray(**init_kwargs) -> None:
    import ray
    from ray._private import ray_constants

    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", _node_ip_address=LOOPBACK, include_dashboard=False, **init_kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
    start_reaper(os.getpid())
    print(f"ray: local instance listening on {LOOPBACK} only", flush=True)


def start_reaper(driver_pid: int) -> subprocess.Popen:
    """A process that ends ``driver_pid``'s descendants once it has died (it reads their list
    every second while the driver lives)."""
    return subprocess.Popen([sys.executable, "-m", "rlcore.controller.ray_local", str(driver_pid)],
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _reap(driver_pid: int, poll_s: float = 0.5) -> None:
    import psutil

    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    known: dict[int, psutil.Process] = {}
    last_scan = 0.0
    while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() - last_scan > 1.0:
            try:
                known.update({p.pid: p for p in driver.children(recursive=True) if p.pid != os.getpid()})
            except psutil.NoSuchProcess:
                break
            last_scan = time.monotonic()
        time.sleep(poll_s)
    # is_running() compares creation times, so a reused pid is never signalled.
    alive = [p for p in known.values() if p.is_running()]
    for proc in alive:
        _signal(proc, signal.SIGTERM)
    _, alive = psutil.wait_procs(alive, timeout=3)
    for proc in alive:
        _signal(proc, signal.SIGKILL)


def _signal(proc, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except Exception:  # noqa: BLE001 - it may have exited meanwhile
        pass


if __name__ == "__main__":
    _reap(int(sys.argv[1]))
