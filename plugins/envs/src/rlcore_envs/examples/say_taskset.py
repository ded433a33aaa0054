"""A verifiers 0.4 taskset for the tests and the recipe (``rlcore_envs.examples.say_taskset:SayTaskset``): say a number.

Two weighted rewards and a metric on the task; ``RetryEnv`` is a multi-turn ``vf.Env`` whose
``run()`` plays the user: a wrong first answer gets "Try again." and one more turn.
"""

from __future__ import annotations

import verifiers.v1 as vf


class SayData(vf.TaskData):
    answer: str


class SayTask(vf.Task[SayData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.75)
    async def exact(self, trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.25)
    async def short(self, trace) -> float:
        return float(len(trace.last_reply) <= 4)

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class SayTaskset(vf.Taskset[SayTask, vf.TasksetConfig]):
    def load(self):
        for i in range(40):
            yield SayTask(SayData(name=f"say{i % 4}", prompt=f"Say {i % 10}.", answer=str(i % 10)), self.config.task)


class RetryEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class RetryEnv(vf.Env[RetryEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated and segment.last_reply.strip() != task.data.answer:
                await interaction.turn("Try again.")

    async def finalize(self, task, episode):
        for trace in episode.traces:
            trace.record_metric("retried", float(trace.num_turns > 1))


__all__ = ["SayTaskset"]
