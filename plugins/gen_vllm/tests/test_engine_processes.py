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
    import json, os, signal, sys, threading, time, traceback
    import psutil
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import VllmGenerator
    from rlcore_vllm.shm_segments import mapped_segments

    if __name__ == "__main__":
        gen = VllmGenerator(sys.argv[1], VllmConfig(enforce_eager=True, kv_cache_space_gib=0.125, max_num_seqs=8),
                            max_model_len=64, dtype="float32", seed=0)
        from rlcore.interfaces import SamplingParams
        params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
        gen.generate([[5, 6, 7]], params)
        engines = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
        segments = sorted(set().union(*(mapped_segments(p.pid) for p in engines)))
        core = next(p for p in engines if p.name() == "VLLM::EngineCore")
        core.suspend()  # stopped: the request below is sent and waits for an answer that never comes
        outcome = []
        def generate():
            try:
                gen.generate([[5, 6, 7]], params)
                outcome.append("returned")
            except Exception as exc:
                outcome.append(type(exc).__name__)
        waiting = threading.Thread(target=generate, daemon=True)
        waiting.start()
        until = time.monotonic() + 120
        while waiting.is_alive() and time.monotonic() < until:  # until it waits for the engine's answer
            if "get_output" in "".join(traceback.format_stack(sys._current_frames()[waiting.ident])):
                break
            time.sleep(0.05)
        core.send_signal(signal.SIGKILL)  # the fault: an engine core that never runs its own cleanup
        core.wait(30)                     # (what vLLM's shutdown does to one that overruns its 5 s)
        waiting.join(120)  # woken once the client has seen the death (seconds); past this it waits forever
        gen.shutdown()
        print(json.dumps({"segments": segments, "left": [s for s in segments if os.path.exists(f"/dev/shm/{s}")],
                          "waiting_call": outcome or ["still waiting"]}), flush=True)
""")


@pytest.fixture(scope="module")
def core_killed(vllm_model_dir, tmp_path_factory) -> tuple[dict, str]:
    """One driver whose engine core is killed (SIGKILL) while a ``generate`` waits on it, then shut
    down: what it reported, and its stderr."""
    script = tmp_path_factory.mktemp("leaves") / "leaves.py"
    script.write_text(LEAVES)
    done = subprocess.run([sys.executable, str(script), str(vllm_model_dir)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_an_engine_core_killed_at_shutdown_leaves_no_shared_memory_behind(core_killed):
    """The engine core's queue to its worker is a shared-memory segment it removes as it exits; one
    killed first (vLLM kills an engine core that overruns its shutdown grace) leaves it, and the
    run ended with the resource tracker's "leaked shared_memory objects" warning. The generator's
    shutdown removes what the engine's processes left."""
    report, stderr = core_killed
    assert report["segments"], "the engine's processes mapped no shared-memory segment: nothing was tested"
    assert report["left"] == []
    assert "leaked shared_memory" not in stderr, stderr[-2000:]


def test_a_generate_waiting_on_an_engine_core_that_dies_raises(core_killed):
    """vLLM's sync client marks its engine dead when the engine core's process ends, but left a call
    already waiting on it waiting forever (a SIGTERM to the run's process group ends the engine core
    mid-step): the call raises vLLM's EngineDeadError instead."""
    report, stderr = core_killed
    assert report["waiting_call"] == ["EngineDeadError"], (report["waiting_call"], stderr[-3000:])
