"""The OpenAI-compatible endpoint agents talk to during rollouts: ``/v1/chat/completions`` and
``/v1/completions`` on 127.0.0.1, backed by the run's generator (:class:`rlcore.interfaces.AsyncTokenGenerator`).

FastAPI serves it, under uvicorn, in the event loop the agents run in (so that a generator bound
to that loop, such as vLLM's async engine, serves its requests directly). Each trajectory has a key:
the ``api_key`` its client sends (``Authorization: Bearer <key>``), or the path prefix
``/trajectories/<key>/v1``. A request for a key not open now is refused (401), ``/v1/models``
included. The model is served as ``policy`` and as the run's ``policy.model_name``; another name
is a 404 ``model_not_found``. ``tools`` on a chat template that renders none is a 400 naming it.

Limits, per trajectory: the request body (``max_request_bytes``, 413), model requests
(``max_turns``, 429), requests in flight or waiting (``max_concurrent_requests``, 429; they are
served one after another, so the recorded conversation is a sequence), and tokens: each reply is
cut to what ``policy.max_total_sequence_length`` leaves (``finish_reason: length``; a prompt that
no longer fits gets an empty ``length`` reply).

Sampling follows the run (temperature, top-p/k: the policy's rollout distribution, whose logprobs
train), whatever a request asks; a request's ``max_tokens`` (at most the run's ``max_new_tokens``),
``stop`` and ``seed`` apply. Replies carry the engine's token ids and logprobs as well
(``token_ids``, ``prompt_token_ids``; ``logprobs`` when asked).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) at runtime.

import asyncio
import contextlib
import json
import socket
import time
import attrs

from rlcore.agents.recorder import RequestError, TrajectoryRecorder, parse_tool_calls, template_name, template_takes_tools
from rlcore.generation.rollout import ChatSuffixes
from rlcore.interfaces import AsyncTokenGenerator, SamplingParams

HOST = "127.0.0.1"
_DEFAULT_MODEL = "policy"  # served always; a request may also leave 'model' out


class UnknownModelError(ValueError):
    """A request for a model the endpoint does not serve (HTTP 404 ``model_not_found``)."""


class LimitError(RuntimeError):
    """A trajectory went over one of its limits (HTTP 413/429); counted as cause ``limit``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@attrs.define
class OpenTrajectory:
    recorder: TrajectoryRecorder
    seed: int | None
    lock: asyncio.Lock = attrs.field(factory=asyncio.Lock)
    waiting: int = 0
    errors: list[str] = attrs.field(factory=list)  # what the endpoint refused or failed on, for the failure's cause
    causes: list[str] = attrs.field(factory=list)
    serving_s: float = 0.0  # wall seconds of this trajectory's requests, from arrival to reply (the agent waits on them)


class Endpoint:
    """Open trajectories by key and serve their requests through the generator."""

    def __init__(self, generator: AsyncTokenGenerator, tokenizer, *, max_total_tokens: int, max_turns: int,
                 max_request_bytes: int, max_concurrent_requests: int, served_models: tuple[str, ...] = (_DEFAULT_MODEL,)):
        self.generator, self.tokenizer = generator, tokenizer
        # what the chat template renders around a turn (ChatSuffixes), for the recorder; none without a template
        self.suffixes = ChatSuffixes(tokenizer) if getattr(tokenizer, "chat_template", None) else None
        self.served_models = tuple(dict.fromkeys(served_models))  # the names a request's 'model' may give
        self.max_total_tokens, self.max_turns = max_total_tokens, max_turns
        self.max_request_bytes, self.max_concurrent = max_request_bytes, max_concurrent_requests
        self.params = SamplingParams()
        self._takes_tools: bool | None = None  # whether the chat template shows tools (probed at the first request with tools)
        self.trajectories: dict[str, OpenTrajectory] = {}
        self.port: int | None = None
        self._server = None
        self._task: asyncio.Task | None = None

    # ---- trajectories -------------------------------------------------------------------------
    def open(self, key: str, seed: int | None) -> OpenTrajectory:
        traj = OpenTrajectory(TrajectoryRecorder(key, self.tokenizer, self.suffixes), seed)
        self.trajectories[key] = traj
        return traj

    def close(self, key: str) -> None:
        self.trajectories.pop(key, None)

    def base_url(self, key: str | None = None) -> str:
        return f"http://{HOST}:{self.port}" + (f"/trajectories/{key}/v1" if key else "/v1")

    # ---- serving ------------------------------------------------------------------------------
    async def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, 0))  # loopback only: nothing off this machine can reach it
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self), log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=30)
        self._server = _quiet_server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped the server
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = None
        self.trajectories.clear()

    # ---- one request --------------------------------------------------------------------------
    def trajectory(self, key: str | None) -> OpenTrajectory:
        traj = self.trajectories.get(key or "")
        if traj is None:
            raise PermissionError("unknown trajectory key: send the key rlcore gave this trajectory's client "
                                  "(its api_key, or the /trajectories/<key>/v1 base URL)")
        return traj

    async def serve(self, traj: OpenTrajectory, body: dict, chat: bool) -> dict:
        rec = traj.recorder
        model = body.get("model")
        if model is not None and model not in self.served_models:
            raise UnknownModelError(f"trajectory {rec.key}: the model {model!r} does not exist here; this endpoint serves "
                                    f"{' and '.join(map(repr, self.served_models))} (the policy being trained)")
        if traj.waiting >= self.max_concurrent:
            raise LimitError(429, f"trajectory {rec.key}: more than {self.max_concurrent} requests at once "
                                  "(env.agent.max_concurrent_requests)")
        traj.waiting += 1
        arrived = time.perf_counter()
        try:
            async with traj.lock:
                if rec.requests >= self.max_turns:
                    raise LimitError(429, f"trajectory {rec.key}: more than {self.max_turns} model requests (env.agent.max_turns)")
                return await (self._chat(traj, body) if chat else self._completion(traj, body))
        finally:
            traj.waiting -= 1
            traj.serving_s += time.perf_counter() - arrived

    def _params(self, traj: OpenTrajectory, body: dict, room: int) -> SamplingParams:
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None and (not isinstance(asked, int) or asked < 1):
            raise RequestError(f"trajectory {traj.recorder.key}: max_tokens must be a positive integer, got {asked!r}")
        if body.get("n", 1) != 1:
            raise RequestError(f"trajectory {traj.recorder.key}: n must be 1 (each sample of a group is a trajectory of its own)")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError(f"trajectory {traj.recorder.key}: stop must be a string or a list of strings, got {stop!r:.60}")
        stop = tuple(stop)
        seed = None if traj.seed is None else traj.seed + 7919 * traj.recorder.requests
        limit = min(self.params.max_new_tokens, asked or self.params.max_new_tokens, room)
        return attrs.evolve(self.params, n=1, max_new_tokens=limit, seed=seed, stop=tuple(dict.fromkeys(self.params.stop + stop)))

    async def _generate(self, traj: OpenTrajectory, seg, new_ids: list[int], body: dict):
        """Append the prompt's new tokens and generate; None when nothing fits any more."""
        room = self.max_total_tokens - seg.total() - len(new_ids)
        if room <= 0:
            seg.finish_reason = "length"
            return None
        params = self._params(traj, body, room)
        try:
            out = await self.generator.agenerate(seg.prompt_ids + seg.ids + list(new_ids), params)
        except Exception as exc:  # noqa: BLE001 - the agent gets a 500; the trajectory fails with cause 'endpoint'
            traj.causes.append("endpoint")
            raise RuntimeError(f"trajectory {traj.recorder.key}: the generator failed: {exc!r}") from exc
        # Committed once answered: a failed request's prompt never fills the segment's room for later ones
        traj.recorder.commit_prompt(seg, new_ids)
        return out

    async def _chat(self, traj: OpenTrajectory, body: dict) -> dict:
        rec = traj.recorder
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise RequestError(f"trajectory {rec.key}: 'messages' must be a list of messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or not isinstance(body.get("tools") or [], list):
            raise RequestError(f"trajectory {rec.key}: 'chat_template_kwargs' must be an object and 'tools' a list")
        kwargs = dict(kwargs)
        if body.get("tools"):
            self._check_tools(rec.key)
            kwargs["tools"] = body["tools"]
        seg, new_ids = rec.chat_prompt(messages, kwargs)
        prompt_len = seg.total() + len(new_ids)
        out = await self._generate(traj, seg, new_ids, body)
        if out is None:
            return _chat_reply(rec.key, {"role": "assistant", "content": ""}, "length", [], [], prompt_len, body)
        content, calls = parse_tool_calls(out.text, f"call-{rec.key}-{rec.requests}") if body.get("tools") else (out.text, [])
        reply = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        rec.record(seg, out, messages, reply)
        finish = "tool_calls" if calls and out.finish_reason == "stop" else _finish(out.finish_reason)
        return _chat_reply(rec.key, reply, finish, out.response_ids, out.response_logprobs, prompt_len, body,
                           prompt_ids=seg.prompt_ids + seg.ids[: len(seg.ids) - len(out.response_ids)])

    def _check_tools(self, key: str) -> None:
        """A template that renders no tools would hide them from the model: refused, not ignored."""
        if self._takes_tools is None:
            self._takes_tools = template_takes_tools(self.tokenizer)
        if not self._takes_tools:
            raise RequestError(f"trajectory {key}: the request has 'tools' but the chat template of "
                               f"{template_name(self.tokenizer)} has no tool support (it renders no tools); send tool calls "
                               "as text, or use a model whose template takes tools (Qwen2.5, Qwen3, Llama 3.1+)")

    async def _completion(self, traj: OpenTrajectory, body: dict) -> dict:
        rec = traj.recorder
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))):
            raise RequestError(f"trajectory {rec.key}: 'prompt' must be one text or one list of token ids")
        if isinstance(prompt, list):
            self._check_token_ids(rec.key, prompt)
        seg, new_ids = rec.completion_prompt(prompt)
        prompt_len = seg.total() + len(new_ids)
        out = await self._generate(traj, seg, new_ids, body)
        if out is None:
            return _completion_reply(rec.key, "", "length", [], [], prompt_len, body)
        rec.record(seg, out, None, None, prompt_text=prompt if isinstance(prompt, str) else None)
        return _completion_reply(rec.key, out.text, _finish(out.finish_reason), out.response_ids, out.response_logprobs,
                                 prompt_len, body)

    def _check_token_ids(self, key: str, ids: list) -> None:
        """Token ids of the vocabulary only: one out of it (negative, or past the tokenizer's) would reach
        the generator, where vLLM's worker aborts on it and takes the run down."""
        vocab = len(self.tokenizer)
        bad = next((t for t in ids if isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"trajectory {key}: token id {bad!r} in 'prompt' is outside the vocabulary [0, {vocab})")


def _finish(reason: str) -> str:
    return "length" if reason in ("length", "truncated_prompt") else "stop"


def _logprobs(ids: list[int], logprobs: list[float]) -> dict:
    return {"content": [{"token": str(t), "logprob": float(lp), "bytes": None, "top_logprobs": []} for t, lp in zip(ids, logprobs)]}


def _usage(prompt_len: int, ids: list[int]) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": len(ids), "total_tokens": prompt_len + len(ids)}


def _chat_reply(key, message, finish, ids, logprobs, prompt_len, body, prompt_ids=None) -> dict:
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": _logprobs(ids, logprobs) if body.get("logprobs") else None,
              "token_ids": list(ids)}
    return {"id": f"chatcmpl-{key}-{time.monotonic_ns()}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or _DEFAULT_MODEL, "choices": [choice], "usage": _usage(prompt_len, ids),
            "prompt_token_ids": prompt_ids}


def _completion_reply(key, text, finish, ids, logprobs, prompt_len, body) -> dict:
    lp = None
    if body.get("logprobs") is not None:
        lp = {"tokens": [str(t) for t in ids], "token_logprobs": [float(x) for x in logprobs], "top_logprobs": None, "text_offset": None}
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp, "token_ids": list(ids)}
    return {"id": f"cmpl-{key}-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or _DEFAULT_MODEL, "choices": [choice], "usage": _usage(prompt_len, ids)}


def _quiet_server(config):
    """uvicorn's server without its signal handlers: the run loop owns SIGINT, SIGTERM and SIGALRM."""
    import uvicorn

    class QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return QuietServer(config)


def _error(status: int, message: str, kind: str, code: str | int | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status if code is None else code}}, status_code=status)


def _bearer(request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def _refuse(traj: OpenTrajectory, status: int, message: str):
    traj.errors.append(message)
    traj.causes.append("limit")
    return _error(status, message, "rate_limit_error" if status == 429 else "invalid_request_error")


def _failed(traj: OpenTrajectory, key: str, exc: Exception):
    """The response to a request that failed, its cause noted on the trajectory (the attempt fails with it)."""
    if isinstance(exc, LimitError):
        return _refuse(traj, exc.status, str(exc))
    traj.errors.append(str(exc))
    if isinstance(exc, UnknownModelError):
        traj.causes.append("request")
        return _error(404, str(exc), "invalid_request_error", "model_not_found")
    if isinstance(exc, (RequestError, json.JSONDecodeError)):  # ours, or the body's JSON
        traj.causes.append("request")
        return _error(400, f"trajectory {key}: {exc}" if key not in str(exc) else str(exc), "invalid_request_error")
    if "endpoint" not in traj.causes:  # a generator failure: 500
        traj.causes.append("endpoint")
    return _error(500, str(exc), "server_error")


def _model_list(endpoint: Endpoint, key: str | None):
    """``/v1/models``: the served names, to an open trajectory's key only."""
    try:
        endpoint.trajectory(key)
    except PermissionError as exc:
        return _error(401, str(exc), "authentication_error")
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rlcore"}
                                       for name in endpoint.served_models]}


async def _read_at_most(request, limit: int) -> bytes | None:
    """The request's body, or None once it has gone over ``limit`` bytes (the rest is not read)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _parse(raw: bytes):
    import json

    try:
        return json.loads(raw)
    except RecursionError:  # nesting deeper than the parser's stack: a bad request, not the server's failure
        raise RequestError("the request body nests deeper than can be parsed") from None


def build_app(endpoint: Endpoint):
    """The FastAPI app: the two OpenAI routes and ``models``, at ``/v1`` (key in the bearer token)
    and at ``/trajectories/<key>/v1``."""
    from fastapi import FastAPI, Request

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    async def handle(request: Request, key: str | None, chat: bool):
        key = _bearer(request) if key is None else key
        try:
            traj = endpoint.trajectory(key)
        except PermissionError as exc:
            return _error(401, str(exc), "authentication_error")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > endpoint.max_request_bytes:
            return _refuse(traj, 413, f"trajectory {key}: request of {declared} bytes, over env.agent.max_request_bytes "
                                      f"({endpoint.max_request_bytes})")
        raw = await _read_at_most(request, endpoint.max_request_bytes)
        if raw is None:  # no Content-Length (a chunked body): refused as soon as it goes over, not at its end
            return _refuse(traj, 413, f"trajectory {key}: request of more than {endpoint.max_request_bytes} bytes, over "
                                      f"env.agent.max_request_bytes")
        try:
            body = _parse(raw)
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            return await endpoint.serve(traj, body, chat)
        except Exception as exc:  # noqa: BLE001 - every failure is a response and the trajectory's cause
            return _failed(traj, key, exc)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, None, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, None, False)

    @app.post("/trajectories/{key}/v1/chat/completions")
    async def chat_at(key: str, request: Request):
        return await handle(request, key, True)

    @app.post("/trajectories/{key}/v1/completions")
    async def completions_at(key: str, request: Request):
        return await handle(request, key, False)

    @app.get("/v1/models")
    async def models(request: Request):
        return _model_list(endpoint, _bearer(request))

    @app.get("/trajectories/{key}/v1/models")
    async def models_at(key: str):
        return _model_list(endpoint, key)

    return app
