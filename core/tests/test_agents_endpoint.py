"""The agents' endpoint and runner on the real ``hf`` generator (a tiny random Llama): loopback only,
unknown keys and over-limit requests refused, failures retried or their groups dropped (counted by
cause, never scored), a hung agent stopped with an error naming its trajectory."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess

import pytest

from rlcore.config.agents import AgentEnvConfig
from rlcore.agents.runner import AgentRunner
from rlcore.deadlines import GenerationTimeout
from rlcore.interfaces import Sample, SamplingParams

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def generator(tiny_model_dir):
    from rlcore.config.hf_generation import HFGenerationConfig
    from rlcore.generation.hf_generator import HFGenerator

    return HFGenerator(str(tiny_model_dir), HFGenerationConfig(), 128)


def samples(count: int) -> list[Sample]:
    return [Sample(prompt=[{"role": "user", "content": f"{i}+1="}], answer=str(i + 1), index=100 + i) for i in range(count)]


def runner_for(generator, agent, timeout_s: float = 120.0, **cfg) -> AgentRunner:
    return AgentRunner(generator, generator.tokenizer, agent, AgentEnvConfig(function="x:y", **cfg), max_total_tokens=64,
                       timeout_s=timeout_s)


PARAMS = SamplingParams(n=2, max_new_tokens=3, seed=1)


async def ask(client, sample) -> str:
    reply = await client.chat.completions.create(model="policy", messages=sample.prompt, max_tokens=3)
    return reply.choices[0].message.content


def test_endpoint_listens_on_loopback_only_and_refuses_unknown_keys_and_limits(generator):
    seen = {}

    async def agent(client, sample):
        port = int(str(client.base_url).split(":")[2].split("/")[0])
        seen["ss"] = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
        seen["port"] = port
        async with httpx.AsyncClient() as raw:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            body = {"model": "policy", "messages": sample.prompt}
            seen["unknown"] = (await raw.post(url, json=body, headers={"Authorization": "Bearer not-a-trajectory"})).status_code
            seen["huge"] = (await raw.post(url, json={**body, "pad": "x" * 5000}, headers={"Authorization": f"Bearer {client.api_key}"})).status_code
            # the key in the path works as well as the bearer token
            path_url = f"http://127.0.0.1:{port}/trajectories/{client.api_key}/v1/completions"
            seen["path"] = (await raw.post(path_url, json={"model": "policy", "prompt": "1+1=", "max_tokens": 2})).json()
        await ask(client, sample)  # the second model request of a trajectory allowed one
        return 1.0

    runner = runner_for(generator, agent, max_request_bytes=4096, max_turns=1, max_retries=0)
    with pytest.raises(RuntimeError, match="every one of the 1 agent groups"):
        runner(samples(1), SamplingParams(n=1, max_new_tokens=3, seed=1))
    listening = [line.split()[3] for line in seen["ss"].splitlines() if line.split()[3].endswith(f":{seen['port']}")]
    assert listening == [f"127.0.0.1:{seen['port']}"]  # not 0.0.0.0, not [::]
    assert seen["unknown"] == 401 and seen["huge"] == 413
    assert len(seen["path"]["choices"][0]["token_ids"]) >= 1
    assert runner.metrics()["rollout/infra_failures/limit"] == 1  # over max_turns: a failure, not a reward of 0


def test_bad_requests_are_refused_before_any_generator_and_a_chunked_body_while_read(generator):
    """Token ids outside the vocabulary (vLLM's worker aborts on them), a ``stop`` or
    ``chat_template_kwargs`` of the wrong type, JSON nested past the parser's depth: 400, and the
    generator is never asked. A chunked body (no Content-Length) over max_request_bytes: 413 once
    it goes over, the rest never read."""
    seen, sent = {}, []

    class Counting(Recording):
        asked = 0

        async def agenerate(self, prompt_ids, params):
            Counting.asked += 1
            return await super().agenerate(prompt_ids, params)

    def resident() -> int:  # this process's resident bytes now: the endpoint runs in it
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    async def chunks():
        start = resident()
        for _ in range(4096):  # 256 MiB, which a server reading to the end holds at once
            sent.append(resident() - start)
            yield b" " * 65536

    async def agent(client, sample):
        port = int(str(client.base_url).split(":")[2].split("/")[0])
        headers = {"Authorization": f"Bearer {client.api_key}"}
        vocab = len(generator.tokenizer)
        async with httpx.AsyncClient() as raw:
            base = f"http://127.0.0.1:{port}/v1"
            for name, route, body in (("negative", "completions", {"prompt": [-5, 3]}),
                                      ("past_vocab", "completions", {"prompt": [3, vocab]}),
                                      ("bool", "completions", {"prompt": [True, 3]}),
                                      ("stop", "completions", {"prompt": "1+1=", "stop": 5}),
                                      ("stop_list", "chat/completions", {"messages": sample.prompt, "stop": [1]}),
                                      ("kwargs", "chat/completions", {"messages": sample.prompt, "chat_template_kwargs": 5})):
                reply = await raw.post(f"{base}/{route}", json={"model": "policy", **body}, headers=headers)
                seen[name] = (reply.status_code, reply.json()["error"]["message"])
            deep = "[" * 20000 + "]" * 20000  # past the parser's depth, within max_request_bytes
            reply = await raw.post(f"{base}/completions", content=deep, headers={**headers, "content-type": "application/json"})
            seen["deep"] = (reply.status_code, reply.json()["error"]["message"])
            try:
                reply = await raw.post(f"{base}/completions", content=chunks(), headers=headers)
                seen["chunked"] = reply.status_code
            except httpx.HTTPError as exc:  # the server closed the connection on an unread body: refused too
                seen["chunked"] = type(exc).__name__
        return 1.0

    runner = runner_for(Counting(generator), agent, max_request_bytes=1 << 16, max_retries=0, max_turns=20)
    with pytest.raises(RuntimeError, match="every one of the 1 agent groups"):
        runner(samples(1), SamplingParams(n=1, max_new_tokens=3, seed=1))
    for name in ("negative", "past_vocab", "bool", "stop", "stop_list", "kwargs", "deep"):
        assert seen[name][0] == 400, (name, seen[name])
    assert "token id -5" in seen["negative"][1] and "outside the vocabulary" in seen["past_vocab"][1]
    assert "stop must be" in seen["stop"][1] and "nests deeper" in seen["deep"][1]
    assert Counting.asked == 0
    assert seen["chunked"] in (413, "RemoteProtocolError", "WriteError", "ReadError"), seen["chunked"]
    assert max(sent) < 64 << 20, f"the process grew by {max(sent) >> 20} MiB while the body was sent"


def test_a_failed_generator_request_leaves_no_prompt_behind_in_the_trajectory(generator):
    """The generator fails the first request (500); the next one is fed its own prompt once, not
    after the failed one's: failed requests never fill the trajectory's room."""
    statuses = []

    class FailsFirst(Recording):
        failed = False

        async def agenerate(self, prompt_ids, params):
            self.calls.append((list(prompt_ids), [], []))
            if not self.failed:
                self.failed = True
                raise RuntimeError("engine hiccup")
            return await self.inner.agenerate(prompt_ids, params)

    async def agent(client, sample):
        port = int(str(client.base_url).split(":")[2].split("/")[0])
        async with httpx.AsyncClient() as raw:
            for _ in range(2):
                reply = await raw.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "1+1=", "max_tokens": 2},
                                       headers={"Authorization": f"Bearer {client.api_key}"})
                statuses.append(reply.status_code)
        return 1.0

    failing = FailsFirst(generator)
    with pytest.raises(RuntimeError, match="every one of the 1 agent groups"):  # cause 'endpoint': the attempt fails
        runner_for(failing, agent, max_retries=0)(samples(1), SamplingParams(n=1, max_new_tokens=2, seed=1))
    assert statuses == [500, 200]
    assert failing.calls[1][0] == failing.calls[0][0]


def test_five_percent_agent_failures_are_retried_or_their_groups_dropped(generator):
    """5% of attempts raise (seeded), after a model request; sample 103 always fails. Retried
    trajectories keep only their successful attempt's tokens; the always-failing group is dropped
    and takes no part in any advantage; failures are counted by cause."""
    import torch

    from rlcore.algorithms.grpo import GRPO

    rng = random.Random(0)
    succeeded: dict[str, str] = {}  # trajectory key -> the text the model wrote in that attempt
    failed_attempts = []

    async def flaky(client, sample):
        text = await ask(client, sample)
        if sample.index == 103 or rng.random() < 0.05:
            failed_attempts.append(client.api_key)
            raise ConnectionError("tool sandbox crashed (injected)")
        succeeded[client.api_key] = text
        return float(text.strip() == sample.answer)

    runner = runner_for(generator, flaky, max_retries=3)  # four failures in a row elsewhere: p = 44 * 0.05**4 < 3e-4
    batch = samples(12)
    results = runner(batch, SamplingParams(n=4, max_new_tokens=3, seed=1))
    counts = runner.metrics()
    assert [len(group) for group in results] == [0 if s.index == 103 else 4 for s in batch]
    assert counts["rollout/dropped_groups"] == 1
    assert counts["rollout/infra_failures/agent_error"] == counts["rollout/infra_failures"] == len(failed_attempts) > 3
    kept = [t for group in runner.last_trajectories for t in group]
    assert {t.key for t in kept} <= set(succeeded) and not {t.key for t in kept} & set(failed_attempts)
    assert counts["rollout/agent_retries"] == sum(t.attempts - 1 for t in kept) == len(failed_attempts) - 4 * 4
    # what the loop computes advantages on: the 11 surviving groups, nothing of sample 103
    rewards_N = torch.tensor([t.reward for t in kept])
    groups_N = torch.tensor([g for g, group in enumerate(runner.last_trajectories) for _ in group])
    advantages_N = GRPO().advantages(rewards_N, groups_N)
    assert advantages_N.shape == (44,) and torch.isfinite(advantages_N).all() and 3 not in groups_N.tolist()


def test_a_failed_group_is_rolled_out_again_whole(generator):
    calls = {"n": 0}

    async def fails_once_per_group(client, sample):
        await ask(client, sample)
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("malformed tool output (injected)")
        return {"reward": 1.0, "metrics": {"correct": 1.0}}

    runner = runner_for(generator, fails_once_per_group, max_retries=0, on_group_failure="resample")
    results = runner(samples(1), PARAMS)
    assert len(results[0]) == 2 and runner.metrics()["rollout/resampled_groups"] == 1
    assert runner.metrics().get("rollout/dropped_groups") == 0


def test_a_bad_reward_or_no_request_is_a_failure_not_a_zero(generator):
    async def nan_reward(client, sample):
        await ask(client, sample)
        return float("nan")

    async def no_request(client, sample):
        return 1.0

    for agent, cause in ((nan_reward, "malformed"), (no_request, "no_request")):
        runner = runner_for(generator, agent, max_retries=1)
        with pytest.raises(RuntimeError, match="every one"):
            runner(samples(1), PARAMS)
        assert runner.metrics()[f"rollout/infra_failures/{cause}"] == 4  # 2 trajectories x 2 attempts


@pytest.mark.wall_clock
def test_a_hung_agent_stops_the_batch_naming_its_trajectory(generator):
    async def hangs(client, sample):
        await ask(client, sample)
        if sample.index == 101:
            await asyncio.sleep(3600)
        return 1.0

    runner = runner_for(generator, hangs, timeout_s=3.0)
    with pytest.raises(GenerationTimeout, match=r"sample 101, trajectory \d, attempt 0; 1 requests served"):
        runner(samples(2), PARAMS)
    # with attempt_timeout_s, a hung attempt is a counted failure and is retried
    runner = runner_for(generator, hangs, attempt_timeout_s=0.5, max_retries=1)
    results = runner(samples(2), PARAMS)
    assert [len(g) for g in results] == [2, 0] and runner.metrics()["rollout/infra_failures/timeout"] == 4


def test_a_plain_function_agent_gets_a_blocking_client_in_a_thread(generator):
    import threading

    threads = set()

    def blocking(client, sample):
        threads.add(threading.current_thread().name)
        reply = client.chat.completions.create(model="policy", messages=sample.prompt, max_tokens=3)
        return float(bool(reply.choices[0].token_ids))

    runner = runner_for(generator, blocking)
    results = runner(samples(2), PARAMS)
    assert [len(g) for g in results] == [2, 2] and all(t.reward == 1.0 for g in runner.last_trajectories for t in g)
    assert all(name.startswith("rlcore-agent") for name in threads)


@pytest.mark.wall_clock
def test_a_hung_plain_function_agent_is_left_on_a_daemon_thread(generator):
    """Abandoned at its attempt timeout, a blocking agent keeps only a daemon thread: nothing joins it at exit."""
    import threading

    released, hung = threading.Event(), []

    def blocking(client, sample):
        if sample.index == 101:
            hung.append(threading.current_thread())
            released.wait(60)
        return 1.0 if client.chat.completions.create(model="policy", messages=sample.prompt, max_tokens=3) else 0.0

    runner = runner_for(generator, blocking, attempt_timeout_s=3.0, max_retries=0)
    try:
        results = runner(samples(2), PARAMS)
        assert [len(g) for g in results] == [2, 0]
        assert hung and all(t.daemon and t.is_alive() for t in hung)
    finally:
        released.set()


class Recording:
    """The real generator; what each ``agenerate`` was fed and returned is kept."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.calls = inner, inner.tokenizer, []

    async def agenerate(self, prompt_ids, params):
        out = await self.inner.agenerate(prompt_ids, params)
        self.calls.append((list(prompt_ids), list(out.response_ids), list(out.response_logprobs)))
        return out


def test_trainable_tokens_are_the_real_generators_own_with_and_without_a_rewrite(generator):
    """Two requests that extend the conversation, then a rewritten one (a new segment): each
    segment's loss-mask-1 tokens are exactly the ids and logprobs the generator returned, in order;
    every prompt it was fed is a prefix of its segment; all else is masked with logprob 0."""
    async def agent(client, sample):
        messages = list(sample.prompt)
        for _ in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "go"}]
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}], max_tokens=3)
        return 1.0

    recording = Recording(generator)
    runner = AgentRunner(recording, generator.tokenizer, agent, AgentEnvConfig(function="x:y", max_turns=3),
                         max_total_tokens=120, timeout_s=120.0)
    (group,) = runner(samples(1), SamplingParams(n=1, max_new_tokens=3, seed=1))
    (result,) = group
    segments = [*(result.segments or []), result]
    assert len(segments) == 2 and len(recording.calls) == 3
    for segment, calls in zip(segments, [recording.calls[:2], recording.calls[2:]]):
        full = segment.prompt_ids + segment.response_ids
        trained = [(t, lp) for t, lp, m in zip(segment.response_ids, segment.response_logprobs, segment.response_mask) if m]
        assert trained == [(t, lp) for _, ids, lps in calls for t, lp in zip(ids, lps)]
        assert all(lp == 0.0 for lp, m in zip(segment.response_logprobs, segment.response_mask) if not m)
        for fed, ids, _ in calls:
            assert full[: len(fed) + len(ids)] == fed + ids  # nothing before was re-tokenized


def test_tokens_and_concurrency_are_bounded_per_trajectory(generator):
    """A reply is cut to what policy.max_total_sequence_length leaves (then an empty 'length' reply);
    requests beyond max_concurrent_requests are refused (429), and an agent that carries on past a
    refusal fails its attempt (cause 'limit'): its reward is not of the exchange it asked for."""
    import openai

    sample = samples(1)[0]
    prompt_len = len(generator.tokenizer.apply_chat_template(sample.prompt, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False))
    seen = {}

    async def long_replies(client, sample):
        first = await client.chat.completions.create(model="policy", messages=sample.prompt, max_tokens=50)
        messages = [*sample.prompt, {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "more"}]
        second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=50)
        seen["replies"] = [(r.choices[0].finish_reason, r.usage.completion_tokens) for r in (first, second)]
        return 1.0

    runner = AgentRunner(generator, generator.tokenizer, long_replies, AgentEnvConfig(function="x:y"),
                         max_total_tokens=prompt_len + 2, timeout_s=120.0)
    (group,) = runner([sample], SamplingParams(n=1, max_new_tokens=50, seed=1, ignore_eos=True))
    assert seen["replies"] == [("length", 2), ("length", 0)]
    assert len(group[0].prompt_ids) + len(group[0].response_ids) == prompt_len + 2

    async def many_at_once(client, sample):
        asks = [client.chat.completions.create(model="policy", messages=sample.prompt, max_tokens=2) for _ in range(3)]
        seen["outcomes"] = await asyncio.gather(*asks, return_exceptions=True)
        return 1.0

    class HeldUntilRefused(Recording):
        """The real generator, holding the first request until the other two were refused (no race)."""

        async def agenerate(self, prompt_ids, params):
            while sum(len(t.errors) for t in runner.endpoint.trajectories.values()) < 2:
                await asyncio.sleep(0.01)
            return await super().agenerate(prompt_ids, params)

    runner = runner_for(HeldUntilRefused(generator), many_at_once, timeout_s=60.0, max_retries=0, max_concurrent_requests=1,
                        max_turns=3)
    with pytest.raises(RuntimeError, match="every one"):
        runner(samples(1), SamplingParams(n=1, max_new_tokens=2, seed=1))
    refused = [o for o in seen["outcomes"] if isinstance(o, openai.RateLimitError)]
    assert len(refused) == 2 and "max_concurrent_requests" in str(refused[0])
    assert runner.metrics()["rollout/infra_failures/limit"] == 1


def test_each_running_agent_has_an_http_client_of_its_own_reused_after_it(generator):
    """One connection pool shared by hundreds of agents makes every request scan all their connections;
    each running agent gets its own client, and at most max_env_concurrency are made."""
    running, held, made = set(), [], set()

    async def agent(client, sample):
        http = client._client  # the httpx client the runner lent this agent
        assert http not in running  # no agent running now shares it
        running.add(http)
        made.add(id(http))
        held.append(http)
        await asyncio.sleep(0.05)  # the other agents start meanwhile
        await ask(client, sample)
        running.discard(http)
        return 1.0

    runner = runner_for(generator, agent, max_env_concurrency=3)
    groups = runner(samples(4), SamplingParams(n=2, max_new_tokens=3, seed=1))
    assert sum(len(g) for g in groups) == 8
    assert len(made) == 3  # 8 agents, 3 at a time: 3 clients, each lent again
    assert all(http.is_closed for http in held)  # closed with the call's event loop


def test_an_unknown_model_is_a_404_and_models_are_listed_to_a_trajectory_only(generator):
    """OpenAI's semantics: a model the endpoint does not serve is ``404 model_not_found`` (the
    attempt fails with cause ``request``, never scored); ``/v1/models`` lists the served names to a
    trajectory's key and refuses anyone else; the run's model name is served beside ``policy``."""
    import openai

    seen = {}

    async def agent(client, sample):
        if sample.index == 100:
            async with httpx.AsyncClient() as raw:
                base = str(client.base_url).rstrip("/")
                seen["anonymous"] = (await raw.get(f"{base}/models")).status_code
                seen["models"] = (await raw.get(f"{base}/models", headers={"Authorization": f"Bearer {client.api_key}"})).json()
                seen["models_at"] = (await raw.get(base.replace("/v1", f"/trajectories/{client.api_key}/v1") + "/models")).json()
            reply = await client.chat.completions.create(model="tiny/llama", messages=sample.prompt, max_tokens=2)
            return float(bool(reply.choices[0].token_ids))
        try:
            await client.chat.completions.create(model="gpt-4o", messages=sample.prompt, max_tokens=2)
        except openai.NotFoundError as exc:
            seen["404"] = exc
            raise

    runner = AgentRunner(generator, generator.tokenizer, agent, AgentEnvConfig(function="x:y", max_retries=0),
                         max_total_tokens=64, timeout_s=120.0, served_models=("policy", "tiny/llama"))
    results = runner(samples(2), SamplingParams(n=1, max_new_tokens=2, seed=1))
    assert [len(g) for g in results] == [1, 0] and runner.metrics()["rollout/infra_failures/request"] == 1
    error = seen["404"]
    assert error.status_code == 404 and error.code == "model_not_found"
    assert "'gpt-4o' does not exist" in error.message and "'policy' and 'tiny/llama'" in error.message
    assert seen["anonymous"] == 401
    assert [m["id"] for m in seen["models"]["data"]] == ["policy", "tiny/llama"] == [m["id"] for m in seen["models_at"]["data"]]


def test_an_agents_rollout_reports_its_model_tokens_and_critical_path_as_a_native_one_does(generator):
    """The planner bounds decode by the longest trajectory and the benchmark's multi-turn table reads the same keys:
    an agent's tool seconds are its attempt's time outside its model requests."""
    tool_s = 0.3

    async def two_turns_and_a_tool(client, sample):
        await ask(client, sample)
        await asyncio.sleep(tool_s)  # the agent's tool: no model request open
        await ask(client, sample)
        return 1.0

    runner = runner_for(generator, two_turns_and_a_tool)
    runner(samples(2), PARAMS)
    flat = [t for g in runner.last_trajectories for t in g]
    tokens = [sum(t.result.response_mask) for t in flat]
    metrics = runner.metrics()
    assert metrics["rollout/generated_tokens"] == sum(tokens) > 0
    assert metrics["rollout/longest_trajectory_model_tokens"] == max(tokens)
    assert all(t.env_s >= tool_s for t in flat)  # the requests' seconds are not counted: the sleep's are
    assert metrics["rollout/max_trajectory_env_s"] == max(t.env_s for t in flat) >= metrics["rollout/longest_trajectory_env_s"] >= tool_s
