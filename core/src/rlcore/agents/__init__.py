"""Agentic RL: any agent written against the OpenAI API, trained through an endpoint rlcore serves; imports config, interfaces, deadlines and generation.

- :mod:`rlcore.agents.server`: ``/v1/chat/completions`` and ``/v1/completions`` on 127.0.0.1
  during rollouts, one key per trajectory, backed by the run's generator.
- :mod:`rlcore.agents.recorder`: token in, token out (the exact ids and logprobs per request;
  earlier turns are the recorded tokens; a rewritten history starts a new segment).
- :mod:`rlcore.agents.runner`: runs ``agent(client, sample) -> reward`` per trajectory, retries
  failures, drops or re-samples failed groups, counts them by cause.
- :mod:`rlcore.agents.environment`: the ``agent`` environment (``env.name: agent``,
  ``env.agent.function: module:function``).

FastAPI, uvicorn and openai are the ``rlcore[agents]`` extra, imported only when a run uses the
``agent`` environment. See ``docs/guides/agents.md``.
"""
