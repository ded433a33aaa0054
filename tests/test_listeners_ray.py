"""A one-machine Ray run listens on loopback only, and leaves no Ray process behind a kill -9.

The run's environment, called mid-run with the trainer's Ray actors up, records every listening
socket of the driver's process tree (what ``ss -ltnp`` shows for those processes, via psutil)
and the tree's pids, then kills the driver with SIGKILL."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import yaml

from test_loop import tiny_recipe

pytestmark = pytest.mark.slow

PROBE_RUN = """
import json, os, signal, psutil, rlcore
from rlcore.interfaces import EnvStep

class Probe:
    def step(self, samples, responses):
        tree = [psutil.Process()] + psutil.Process().children(recursive=True)
        listening = []
        for proc in tree:
            try:
                found = proc.net_connections("inet")
            except psutil.Error:
                continue
            listening += [[proc.pid, proc.name(), c.laddr.ip, c.laddr.port] for c in found if c.status == "LISTEN"]
        with open({out!r}, "w") as f:
            json.dump({{"listening": listening, "pids": [[p.pid, p.create_time()] for p in tree[1:]]}}, f)
        os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    rlcore.run(rlcore.load_config({recipe!r}), environment=Probe())
"""


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return address.is_loopback or getattr(address, "ipv4_mapped", None) is not None and address.ipv4_mapped.is_loopback


def test_ray_run_listens_on_loopback_only_and_dies_with_its_driver(tiny_model_dir, tmp_path):
    recipe = tiny_recipe(tiny_model_dir, tmp_path / "run", **{"cluster.use_ray": True, "checkpointing.enabled": False,
                                                               "train.max_num_steps": 1})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    out = tmp_path / "probe.json"
    code = textwrap.dedent(PROBE_RUN.format(out=str(out), recipe=str(tmp_path / "r.yaml")))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == -9, done.stderr[-3000:]
    probe = json.loads(out.read_text())
    names = {name for _, name, _, _ in probe["listening"]}
    assert any("raylet" in n or "gcs" in n for n in names), f"no Ray server seen listening: {probe['listening']}"
    outside = [entry for entry in probe["listening"] if not _loopback(entry[2])]
    assert not outside, f"listening beyond loopback: {outside}"
    deadline = time.monotonic() + 20
    while True:
        left = [pid for pid, created in probe["pids"] if psutil.pid_exists(pid) and _same(pid, created)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"processes of the killed driver still running after 20 s: {[psutil.Process(p).name() for p in left]}"


def _same(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - created) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
