"""The async engine (``AsyncLLM``): multi-turn rollouts with many trajectories in flight, and
non-colocated refit over a gloo broadcast group from a separate trainer process. All tests
share one engine (session fixture)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
import sys
from pathlib import Path

import attrs
import pytest
import torch

from rlcore.interfaces import EnvStep, Sample, SamplingParams
from rlcore.generation.rollout import ChatSuffixes, MultiTurnRunner

from _vllm_helpers import hf_greedy, hf_token_logprobs, perturbed_state_dict, state_dict_trainer, with_weights

pytestmark = pytest.mark.vllm
HERE = Path(__file__).parent


class CountingEnv:
    """Never done before turn 3; the observation names the turn; reward = number of turns seen.
    Each call takes ``latency_s`` (a tool call) and the peak of concurrent calls is recorded."""

    def __init__(self, latency_s: float = 0.0):
        self.calls: list[int] = []
        self.latency_s, self.now, self.peak = latency_s, 0, 0
        self._lock = threading.Lock()

    def step(self, samples, histories):
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(self.latency_s)
        with self._lock:
            self.now -= 1
            self.calls.extend(len(h) for h in histories)
        return [EnvStep(reward=float(len(h)), done=len(h) >= 3, observation=f"turn {len(h) + 1}: go on")
                for h in histories]


class InFlight:
    """Wraps a generator and records how many ``agenerate`` calls were pending at once."""

    def __init__(self, generator):
        self.generator, self.now, self.peak = generator, 0, 0

    async def agenerate(self, prompt_ids, params):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            return await self.generator.agenerate(prompt_ids, params)
        finally:
            self.now -= 1


def test_multi_turn_32_trajectories_3_turns_concurrently(async_generator):
    tok = async_generator.tokenizer
    samples = [Sample(prompt=f"{i}+{i}=", prompt_ids=tok.apply_chat_template(
        [{"role": "user", "content": f"{i}+{i}="}], add_generation_prompt=True, return_dict=False), index=i)
        for i in range(8)]
    env, counted = CountingEnv(latency_s=0.3), InFlight(async_generator)
    runner = MultiTurnRunner(counted, env, tok, max_turns=3, max_total_tokens=async_generator.max_model_len,
                             turn_stop_strings=("\n",))
    results = runner(samples, SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=5))
    trajectories = [t for group in runner.last_trajectories for t in group]
    assert len(results) == 8 and all(len(r) == 4 for r in results) and len(trajectories) == 32
    assert counted.peak >= 16, f"only {counted.peak} turns were in flight at once"
    assert env.peak >= 16, f"only {env.peak} tool calls ran at once (a small thread pool queues them)"
    assert all(t.result.num_turns == 3 and t.reward == 3.0 and t.done for t in trajectories)
    assert sorted(env.calls) == sorted([1, 2, 3] * 32)

    suffixes = ChatSuffixes(tok)
    for t in trajectories:
        r = t.result
        assert len(r.response_mask) == len(r.response_ids) == len(r.response_logprobs)
        # the observation segments are exactly the template's suffix tokens, masked out
        segments, current, model_turns = [], [], 0
        for token, m in zip(r.response_ids, r.response_mask):
            if m == 0:
                current.append(token)
            elif current:
                segments.append(current)
                current = []
        assert len(segments) == 2
        for k, seg in enumerate(segments, start=2):
            observation = suffixes.observation_ids(f"turn {k}: go on")
            assert seg[-len(observation):] == observation
            assert seg[:-len(observation)] in ([], suffixes.end_of_turn_ids)
        assert all(lp == 0.0 for lp, m in zip(r.response_logprobs, r.response_mask) if m == 0)

    # model tokens carry the engine's logprobs given everything before them (nothing re-tokenized)
    probe = trajectories[:4]
    scores = async_generator.score([t.result.prompt_ids + t.result.response_ids for t in probe])
    for t, s in zip(probe, scores):
        n = len(t.result.prompt_ids)
        got = [lp for lp, m in zip(t.result.response_logprobs, t.result.response_mask) if m]
        want = [lp for lp, m in zip(s[n:], t.result.response_mask) if m]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


def test_non_colocated_refit_from_a_trainer_process_over_gloo(async_generator, hf_model, tmp_path):
    pytest.importorskip("rlcore_fsdp2", reason="the trainer process runs the FSDP2 backend (rlcore-fsdp2)")

    new_weights = perturbed_state_dict(hf_model, seed=21)
    reference = with_weights(hf_model, new_weights)
    reference.save_pretrained(tmp_path / "trained")
    async_generator.tokenizer.save_pretrained(tmp_path / "trained")
    prompts = [[5, 6, 7, 8], [3, 40, 41, 42, 43, 44]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    before = [r[0].response_ids for r in async_generator.generate(prompts, greedy)]

    # the sender holds its store's port before printing it, so nothing can take the port meanwhile
    sender = subprocess.Popen([sys.executable, str(HERE / "_broadcast_sender.py"), "--world-size", "2",
                               "--model-dir", str(tmp_path / "trained")], stdout=subprocess.PIPE, text=True)
    try:
        first = sender.stdout.readline()
        assert first, f"the sender exited before holding a port (exit code {sender.wait(timeout=30)})"
        joining = async_generator.join_weight_group("127.0.0.1", json.loads(first)["port"], 2, "gloo", timeout_s=120.0)
        joining.result(timeout=150)
        version = async_generator.weights_version
        received = async_generator.receive_weights()
        out, _ = sender.communicate(timeout=60)
    finally:
        if sender.poll() is None:
            sender.kill()
    assert sender.returncode == 0
    sent = json.loads(out.strip().splitlines()[-1])
    assert received == sent["bytes"] == sum(t.numel() * 4 for t in new_weights.values()) and sent["chunks"] > 1
    assert async_generator.weights_version == version + 1
    after = [r[0].response_ids for r in async_generator.generate(prompts, greedy)]
    assert after == [hf_greedy(reference, p, 12) for p in prompts] and after != before

    # back to the original weights through the colocated path (shared memory into the engine process)
    from rlcore_vllm.transport import ColocatedTransport

    ColocatedTransport(chunk_bytes=64 << 10).transfer(state_dict_trainer(dict(hf_model.state_dict())), async_generator)
    assert [r[0].response_ids for r in async_generator.generate(prompts, greedy)] == before


def test_broadcast_transport_in_one_process(async_generator, hf_model):
    from rlcore.plugins import get_plugin_manager
    from rlcore_vllm.transport import BroadcastTransport

    config = async_generator.config
    async_generator.config = attrs.evolve(config, colocated=attrs.evolve(config.colocated, enabled=False))
    try:
        new_weights = perturbed_state_dict(hf_model, seed=31)
        transport = get_plugin_manager().weight_transport(trainer=state_dict_trainer(new_weights), generator=async_generator)
        assert isinstance(transport, BroadcastTransport) and transport.group_backend == "gloo"
        moved = transport.transfer(state_dict_trainer(new_weights), async_generator)
        seq = [5, 6, 7, 8, 9, 10]
        diff = (torch.tensor(async_generator.score([seq])[0]) - hf_token_logprobs(with_weights(hf_model, new_weights), seq)).abs().max()
        assert moved["bytes"] > 0 and diff < 1e-3
        transport.transfer(state_dict_trainer(dict(hf_model.state_dict())), async_generator)  # same group again
        diff = (torch.tensor(async_generator.score([seq])[0]) - hf_token_logprobs(hf_model, seq)).abs().max()
        assert diff < 1e-3
    finally:
        async_generator.config = config


from rlcore.testing.conformance import GeneratorConformance  # noqa: E402


class TestAsyncConformance(GeneratorConformance):
    @pytest.fixture
    def generator(self, async_generator):
        return async_generator

    @pytest.fixture
    def generator_model_dir(self, vllm_model_dir):
        return vllm_model_dir


class BudgetedEnv:
    """:class:`rlcore.interfaces.TrajectoryTurns`: three turns per trajectory, each with its own budget;
    records when each turn is asked for and answered."""

    def __init__(self):
        self.events, self._lock = [], threading.Lock()

    @staticmethod
    def budget(index: int, trajectory: int, turn: int) -> int:
        return 1 + (5 * index + 3 * trajectory + 2 * turn) % 9

    def turn_max_new_tokens(self, sample, trajectory, turn):
        with self._lock:
            self.events.append(("generate", turn))
        return self.budget(sample.index, trajectory, turn)

    def step_trajectory(self, sample, trajectory, history):
        time.sleep(0.05 * ((sample.index + trajectory) % 3))  # tools of different lengths
        with self._lock:
            self.events.append(("answered", len(history) - 1))
        return EnvStep(reward=1.0, done=len(history) >= 3, observation="ok")

    def step(self, samples, histories):
        raise AssertionError("answered through step_trajectory")


def test_turn_barrier_and_per_turn_budgets_on_the_async_engine(async_generator):
    tok = async_generator.tokenizer
    samples = [Sample(prompt=f"{i}*2=", prompt_ids=tok.apply_chat_template(
        [{"role": "user", "content": f"{i}*2="}], add_generation_prompt=True, return_dict=False), index=i) for i in range(4)]
    env = BudgetedEnv()
    runner = MultiTurnRunner(async_generator, env, tok, max_turns=3, max_total_tokens=async_generator.max_model_len,
                             turn_barrier=True)
    runner(samples, SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=3, ignore_eos=True))
    for turn in (1, 2):  # every turn k+1 asked for only once every turn k was answered
        last_answer = max(i for i, e in enumerate(env.events) if e == ("answered", turn - 1))
        assert last_answer < min(i for i, e in enumerate(env.events) if e == ("generate", turn))
    assert runner.metrics()["rollout/turn_barrier_rounds"] == 2
    for s, group in zip(samples, runner.last_trajectories):
        for k, t in enumerate(group):  # each turn exactly its budget long (per-request max_tokens, ignore_eos)
            runs = [len(run) for run in "".join(map(str, t.result.response_mask)).split("0") if run]
            assert runs == [BudgetedEnv.budget(s.index, k, turn) for turn in range(3)]
