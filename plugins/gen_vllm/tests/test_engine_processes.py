"""vLLM's engine processes on one machine: nothing they run listens beyond loopback, a terminal's
Ctrl-C is not theirs (SIGINT blocked: the driver handles it), and they end with the process that
started them, even one killed with SIGKILL (no handler of its own runs), and the shared memory they
leave is removed with them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent("""
    import sys, time
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import VllmGenerator

    if __name__ == "__main__":
        gen = VllmGenerator(sys.argv[1], VllmConfig(enforce_eager=True, kv_cache_space_gib=0.125, max_num_seqs=8),
                            max_model_len=64, dtype="float32", seed=0)
        from rlcore.interfaces import SamplingParams
        gen.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
        print("READY", flush=True)
        time.sleep(600)
""")


def test_engine_processes_listen_on_loopback_only_and_die_with_a_killed_driver(vllm_model_dir, tmp_path):
    psutil = pytest.importorskip("psutil")
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), str(vllm_model_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        for line in driver.stdout:  # vLLM logs to stdout too; READY once the engine answered a request
            if line.strip() == "READY":
                break
        assert driver.poll() is None, "the driver ended before its engine answered"
        engines = [p for p in psutil.Process(driver.pid).children(recursive=True) if p.name().startswith("VLLM::")]
        assert {p.name() for p in engines} >= {"VLLM::EngineCore"}, [p.name() for p in engines]
        listening = [(p.name(), c.laddr) for p in engines for c in p.net_connections(kind="inet") if c.status == "LISTEN"]
        assert all(addr.ip in ("127.0.0.1", "::1") for _, addr in listening), listening
        blocked = {p.name(): _sigint_blocked(p.pid) for p in engines}
        assert all(blocked.values()), blocked
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        _, alive = psutil.wait_procs(engines, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        for proc in [driver]:
            if proc.poll() is None:
                proc.kill()


def _sigint_blocked(pid: int) -> bool:
    """Whether SIGINT is in the blocked mask of ``pid``'s main thread (Linux's /proc)."""
    mask = next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("SigBlk:"))
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


LEAVES = textwrap.dedent("""
    import json, os, signal, sys
    import psutil
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import VllmGenerator
    from rlcore_vllm.shm_segments import mapped_segments

    if __name__ == "__main__":
        gen = VllmGenerator(sys.argv[1], VllmConfig(enforce_eager=True, kv_cache_space_gib=0.125, max_num_seqs=8),
                            max_model_len=64, dtype="float32", seed=0)
        from rlcore.interfaces import SamplingParams
        gen.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
        engines = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
        segments = sorted(set().union(*(mapped_segments(p.pid) for p in engines)))
        core = next(p for p in engines if p.name() == "VLLM::EngineCore")
        core.send_signal(signal.SIGKILL)  # the fault: an engine core that never runs its own cleanup
        core.wait(30)                     # (what vLLM's shutdown does to one that overruns its 5 s)
        gen.shutdown()
        print(json.dumps({"segments": segments, "left": [s for s in segments if os.path.exists(f"/dev/shm/{s}")]}), flush=True)
""")


def test_an_engine_core_killed_at_shutdown_leaves_no_shared_memory_behind(vllm_model_dir, tmp_path):
    """The engine core's queue to its worker is a shared-memory segment it removes as it exits; one
    killed first (vLLM kills an engine core that overruns its shutdown grace) leaves it, and the
    run ended with the resource tracker's "leaked shared_memory objects" warning. The generator's
    shutdown removes what the engine's processes left."""
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    done = subprocess.run([sys.executable, str(script), str(vllm_model_dir)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["segments"], "the engine's processes mapped no shared-memory segment: nothing was tested"
    assert report["left"] == []
    assert "leaked shared_memory" not in done.stderr, done.stderr[-2000:]
