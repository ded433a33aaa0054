"""OpenEnv through rlcore: a real OpenEnv server (OpenEnv's create_app under uvicorn, started as a local
process), reached by OpenEnv's client, one session per trajectory. The GRPO run through it is
``recipes/grpo_openenv_tiny_cpu.yaml``'s dry run (tests/test_recipes.py), which checks its metrics."""

from __future__ import annotations

import pytest

pytest.importorskip("openenv")

from rlcore.interfaces import SessionEnvironment  # noqa: E402

from rlcore_envs.config import OpenEnvEnvConfig  # noqa: E402
from rlcore_envs.openenv_env import OpenEnvEnvironment, OpenEnvServer  # noqa: E402

SERVER = ["{python}", "-m", "uvicorn", "rlcore_envs.examples.openenv_target:app", "--port", "{port}", "--log-level", "warning"]


@pytest.fixture(scope="module")
def server():
    started = OpenEnvServer(OpenEnvEnvConfig(server_command=tuple(SERVER)))
    yield started
    started.stop()


def test_sessions_keep_their_own_episode(server):
    from rlcore.interfaces import Sample

    env = OpenEnvEnvironment(OpenEnvEnvConfig(base_url=server.url, observation_field="text"))
    assert isinstance(env, SessionEnvironment)
    sample = Sample(prompt="", answer={"reset_args": {"seed": 1}})
    target = str(__import__("random").Random(1).randint(1, 9))
    a, b = env.open_session(sample), env.open_session(sample)
    try:
        first = a.step("0")
        assert not first.done and first.observation == f"No. Say {target}."
        assert b.step(target).done and b.step  # b's episode is untouched by a's wrong try
        last = a.step(target)
        assert last.done and last.reward == 1.0 and last.metrics["correct"] == 1.0 and last.metrics["openenv/steps"] == 2.0
    finally:
        a.close()
        b.close()
    (replayed,) = env.step([sample], [["0", "0"]])
    assert replayed.done and replayed.reward == 0.0 and replayed.metrics["openenv/steps"] == 2.0


def test_a_port_taken_after_it_was_found_free_is_replaced(monkeypatch):
    """The race a free port has (another process binds it before the server does), injected: the first port handed
    out is held by a listening socket; the server exits saying the address is in use, and a new port is taken."""
    import socket

    from rlcore_envs import openenv_env

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    real, handed = openenv_env._free_port, []

    def free_port():
        handed.append(taken if not handed else real())
        return handed[-1]

    monkeypatch.setattr(openenv_env, "_free_port", free_port)
    try:
        started = OpenEnvServer(OpenEnvEnvConfig(server_command=tuple(SERVER)))
        try:
            assert len(handed) == 2 and started.url == f"http://127.0.0.1:{handed[1]}" and handed[1] != taken
        finally:
            started.stop()
    finally:
        held.close()
