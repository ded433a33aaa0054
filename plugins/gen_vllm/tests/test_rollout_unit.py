"""``rlcore.generation.rollout`` with a scripted generator (no engine): token bookkeeping and limits."""

from __future__ import annotations

import asyncio

import pytest

from rlcore.interfaces import EnvStep, GenerationResult, Sample, SamplingParams
from rlcore.generation.rollout import ChatSuffixes, MultiTurnRunner


class ScriptedGenerator:
    """Answers each turn with fixed text; records the prompts and params it was given."""

    def __init__(self, tokenizer, replies: list[str], finish: str = "stop", eos: bool = True):
        self.tok, self.replies, self.finish, self.eos = tokenizer, replies, finish, eos
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def agenerate(self, prompt_ids, params):
        turn = len(self.calls)
        self.calls.append((list(prompt_ids), params))
        await asyncio.sleep(0)
        text = self.replies[min(turn, len(self.replies) - 1)]
        ids = self.tok.encode(text, add_special_tokens=False)[: params.max_new_tokens]
        if self.eos and len(ids) < params.max_new_tokens:
            ids = ids + [self.tok.eos_token_id]
        return GenerationResult(prompt_ids=list(prompt_ids), response_ids=ids, response_logprobs=[-0.5] * len(ids),
                                finish_reason=self.finish, text=text, policy_version=7)


class Env:
    def __init__(self, turns_needed=3, fail=False):
        self.turns_needed, self.fail = turns_needed, fail

    def step(self, samples, histories):
        if self.fail:
            raise RuntimeError("environment bug")
        return [EnvStep(reward=len(h) / 10, done=len(h) >= self.turns_needed, observation=f"obs{len(h)}") for h in histories]


def _sample(tok):
    return Sample(prompt="q", prompt_ids=tok.apply_chat_template([{"role": "user", "content": "q"}],
                                                                  add_generation_prompt=True, return_dict=False))


def test_turns_are_appended_without_retokenizing(tiny_tokenizer):
    gen = ScriptedGenerator(tiny_tokenizer, ["a1", "b22", "c333"])
    runner = MultiTurnRunner(gen, Env(), tiny_tokenizer, max_turns=3, max_total_tokens=200, turn_stop_strings=("\n",))
    [[traj]] = asyncio.run(runner.arun([_sample(tiny_tokenizer)], SamplingParams(max_new_tokens=10, stop=("X",))))
    r = traj.result
    eos = tiny_tokenizer.eos_token_id
    enc = lambda s: tiny_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    obs = ChatSuffixes(tiny_tokenizer).observation_ids
    expected = enc("a1") + [eos] + obs("obs1") + enc("b22") + [eos] + obs("obs2") + enc("c333") + [eos]
    assert r.response_ids == expected
    assert r.response_mask == [1] * 3 + [0] * len(obs("obs1")) + [1] * 4 + [0] * len(obs("obs2")) + [1] * 5
    assert [lp for lp, m in zip(r.response_logprobs, r.response_mask) if m == 0] == [0.0] * (len(expected) - 12)
    assert traj.reward == pytest.approx(0.3) and traj.done and r.num_turns == 3 and r.policy_version == 7
    assert traj.turns == ["a1", "b22", "c333"] and r.text == "c333"  # text: the final turn (what a re-score grades)
    # each turn's prompt is exactly the previous turn's prompt + everything appended since
    prompts = [p for p, _ in gen.calls]
    assert prompts[1][: len(prompts[0])] == prompts[0] and prompts[2][: len(prompts[1])] == prompts[1]
    assert all(p.stop == ("X", "\n") and p.n == 1 for _, p in gen.calls)
    assert tiny_tokenizer.decode(r.prompt_ids + r.response_ids).endswith("obs2<|assistant|>c333</s>")


def test_a_turn_cut_by_a_stop_string_gets_the_end_of_turn_marker(tiny_tokenizer):
    gen = ScriptedGenerator(tiny_tokenizer, ["x"], eos=False)
    runner = MultiTurnRunner(gen, Env(turns_needed=2), tiny_tokenizer, max_turns=2, max_total_tokens=200)
    traj = asyncio.run(runner.run_one(_sample(tiny_tokenizer), SamplingParams(max_new_tokens=10)))
    eos = tiny_tokenizer.eos_token_id
    first_obs = traj.result.response_ids[1 : 1 + 1 + len(ChatSuffixes(tiny_tokenizer).observation_ids("obs1"))]
    assert first_obs[0] == eos and traj.result.response_mask[1] == 0  # marker added, not trained on


def test_total_length_limit_and_per_turn_budget(tiny_tokenizer):
    sample = _sample(tiny_tokenizer)
    gen = ScriptedGenerator(tiny_tokenizer, ["abcdefghij"] * 5, eos=False, finish="length")
    limit = len(sample.prompt_ids) + 14
    runner = MultiTurnRunner(gen, Env(turns_needed=9), tiny_tokenizer, max_turns=5, max_total_tokens=limit)
    traj = asyncio.run(runner.run_one(sample, SamplingParams(max_new_tokens=10)))
    assert len(sample.prompt_ids) + len(traj.result.response_ids) <= limit
    assert traj.result.finish_reason == "length" and traj.result.num_turns < 5
    assert all(p.max_new_tokens <= limit - len(prompt) for prompt, p in gen.calls)


def test_environment_failure_ends_the_trajectory_with_reward_zero(tiny_tokenizer):
    runner = MultiTurnRunner(ScriptedGenerator(tiny_tokenizer, ["a"]), Env(fail=True), tiny_tokenizer, max_turns=3)
    traj = asyncio.run(runner.run_one(_sample(tiny_tokenizer), SamplingParams(max_new_tokens=4)))
    assert traj.reward == 0.0 and traj.done and traj.env_metrics == {"error": 1.0} and traj.result.num_turns == 1


class SessionEnv:
    """A SessionEnvironment: each session counts its own turns (state the histories are not asked for)."""

    def __init__(self, fail_at: int | None = None):
        self.opened, self.closed, self.fail_at = 0, 0, fail_at

    def step(self, samples, histories):  # whole histories: not used by the runner when sessions exist
        raise AssertionError("the runner steps sessions, not the environment")

    def open_session(self, sample):
        env, self.opened = self, self.opened + 1

        class Session:
            turns = 0

            def step(self, turn):
                self.turns += 1
                if env.fail_at == self.turns:
                    raise RuntimeError("server went away")
                return EnvStep(reward=float(turn == "a2"), done=self.turns == 2, observation=f"seen {self.turns}")

            def close(self):
                env.closed += 1

        return Session()


def test_a_session_environment_gets_one_session_per_trajectory_closed_after_it(tiny_tokenizer):
    env = SessionEnv()
    runner = MultiTurnRunner(ScriptedGenerator(tiny_tokenizer, ["a1", "a2"]), env, tiny_tokenizer, max_turns=4)
    traj = asyncio.run(runner.run_one(_sample(tiny_tokenizer), SamplingParams(max_new_tokens=4)))
    assert traj.done and traj.reward == 1.0 and traj.result.num_turns == 2 and (env.opened, env.closed) == (1, 1)
    failing = SessionEnv(fail_at=1)
    runner = MultiTurnRunner(ScriptedGenerator(tiny_tokenizer, ["a1"]), failing, tiny_tokenizer, max_turns=4)
    traj = asyncio.run(runner.run_one(_sample(tiny_tokenizer), SamplingParams(max_new_tokens=4)))
    assert traj.reward == 0.0 and traj.env_metrics == {"error": 1.0} and (failing.opened, failing.closed) == (1, 1)


def test_call_returns_n_results_per_sample_and_keeps_trajectories(tiny_tokenizer):
    runner = MultiTurnRunner(ScriptedGenerator(tiny_tokenizer, ["a"]), Env(turns_needed=1), tiny_tokenizer)
    out = runner([_sample(tiny_tokenizer), _sample(tiny_tokenizer)], SamplingParams(max_new_tokens=4, n=3, seed=1))
    assert [len(group) for group in out] == [3, 3] and len(runner.last_trajectories) == 2
    with pytest.raises(ValueError, match="prompt_ids"):
        runner([Sample(prompt="no ids")], SamplingParams())
