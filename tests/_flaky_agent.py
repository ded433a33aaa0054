"""An agent for tests/test_agents_loop.py: 5% of its attempts fail after a model request (seeded),
and every attempt on a problem whose answer ends in 7 fails, so those groups are dropped."""

import random
import re

RNG = random.Random(0)
FAILED: list[str] = []  # answers of the samples whose attempts failed


async def agent(client, sample):
    reply = await client.chat.completions.create(model="policy", messages=sample.prompt)
    if str(sample.answer).endswith("7") or RNG.random() < 0.05:
        FAILED.append(str(sample.answer))
        raise ConnectionError("sandbox crashed (injected)")
    numbers = re.findall(r"-?\d+", reply.choices[0].message.content or "")
    return float(bool(numbers) and numbers[-1] == str(sample.answer))
