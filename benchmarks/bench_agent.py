"""``bench_tool``'s workload as an agent through rlcore's OpenAI-compatible endpoint.

The same three model turns as the ``bench_tool`` environment of ``bench_multiturn_env.py`` (turns
end on the ``777|>`` stop string or at ``max_new_tokens``; a simulated tool latency uniform in
``[0, TOOL_LATENCY_S]``; the tool result ``<result>{len(turn)}</result>`` as the next user turn; a
pseudo-random reward from the last turn), so that ``llama1b-tool-async`` (``rlcore.generation.rollout``) and
``llama1b-tool-agent`` (this agent, an HTTP round trip per turn) of ``bench_grpo_step.py`` time the
same work, and their difference is the endpoint's overhead. Uses the ``openai`` client only.
"""

import asyncio
import hashlib
import random

TURNS = 3
TOOL_LATENCY_S = 0.5
_RNG = random.Random(0)


async def agent(client, sample):
    messages = list(sample.prompt) if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}]
    for turn in range(TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, stop=["777|>"])
        text = reply.choices[0].message.content or ""
        await asyncio.sleep(_RNG.uniform(0.0, TOOL_LATENCY_S))
        if turn == TURNS - 1:
            return float(hashlib.sha256(text.encode()).digest()[0] % 2)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"<result>{len(text)}</result>"}]
