"""An agent for tests/test_agents_loop.py: the trajectories of sample 2 never return."""

import asyncio


async def agent(client, sample):
    await client.chat.completions.create(model="policy", messages=sample.prompt, max_tokens=2)
    if sample.index == 2:
        await asyncio.sleep(3600)
    return 1.0
