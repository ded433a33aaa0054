"""A one-request agent for the CPU demo's 2-digit addition: it asks the policy through the OpenAI
API and grades the reply itself. No rlcore import: any OpenAI-client code trains the same way.

    python -m rlcore.cli.demo --sft-only                 # the demo's SFT warm start (runs/demo/sft)
    python -m rlcore.cli.demo --recipe recipes/grpo_agent_arith_tiny_cpu.yaml
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


async def agent(client, sample):
    """``sample.prompt`` is the chat messages ("12+34="), ``sample.answer`` the sum as text."""
    reply = await client.chat.completions.create(model="policy", messages=sample.prompt)
    numbers = NUMBER.findall(reply.choices[0].message.content or "")
    correct = bool(numbers) and float(numbers[-1]) == float(sample.answer)
    return {"reward": float(correct), "metrics": {"correct": float(correct)}}
