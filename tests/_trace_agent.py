"""An agent for tests/test_rollout_traces.py: two requests per trajectory; the second extends the
conversation (even dataset indices) or rewrites it (odd ones: a new segment); the first attempt
at every third sample raises after its first request (a failure, retried)."""

from collections import Counter

ATTEMPTS: Counter = Counter()


async def agent(client, sample):
    first = (await client.chat.completions.create(model="policy", messages=sample.prompt)).choices[0].message
    ATTEMPTS[sample.index] += 1
    if sample.index % 3 == 0 and ATTEMPTS[sample.index] == 1:
        raise ConnectionError("sandbox crashed (injected)")
    if sample.index % 2 == 0:
        messages = [*sample.prompt, first.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    else:
        messages = [{"role": "user", "content": f"Again: {sample.prompt[-1]['content']}"}]
    second = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
    return float((second.content or "").strip().endswith(str(sample.answer)))
