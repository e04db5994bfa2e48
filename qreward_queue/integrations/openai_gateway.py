"""`qrq gateway`'s OpenAI-compatible front door: any client that takes a base URL gets qrq.

    POST /v1/chat/completions   `model` names a route (or `qrq/<route>`) of chat judges; the
                                body goes to one of its judges, as it came (passthrough.py),
                                through the queue and a worker: the global limiter, breaker,
                                budgets, retries and failover. The reply is the judge's own
                                JSON, byte for byte (its usage, its model name).
    POST /v1/completions        the legacy text completion (`prompt`, a string), the same way
                                to the judge's `{url}/completions`
    GET  /v1/models             the routes a request may name
    any other /v1/...           404 in OpenAI's shape

Per request: `X-Qrq-Priority: val|train|bulk` (limited to the caller's key, see
gateway_keys.py), `X-Qrq-Deadline-S` (else [defaults] deadline_s). With `cache = true` on the
route, a request at temperature 0 is answered from the cache when the same body was answered
before. Concurrent requests reach the queue as micro-batches (trainer/batcher.py).

Errors come in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, with the
status a client's retry logic reads right: 400 a bad request (`stream: true` included), 401 a
wrong key, 403 a priority the key may not use, 404 an unknown model, 429 only when a budget
or the request's deadline refused it (with `x-should-retry: false`: trying again at once
cannot help), 502 when the judge failed after qrq's own retries (also not to be retried),
503 when no worker serves the route (`Retry-After`: a worker may come).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .. import keys
from ..backends import JudgeOptions, make_backend, passthrough
from ..backends.dialects import DIALECTS
from ..config.model import Route
from ..errors import RedisUnreachable, UnknownRoute
from ..ops.job_spend import JobLedger
from ..ops.liveness import live_workers
from ..samples import Outcome
from ..trainer.batcher import MicroBatcher
from ..trainer.runtime import get_app
from .gateway_keys import Job

ROUTE_PREFIX = "qrq/"
PRIORITY_HEADER, DEADLINE_HEADER = "X-Qrq-Priority", "X-Qrq-Deadline-S"
GRACE_S = 5.0  # answer this long after the request's deadline at the latest
LIVENESS_EVERY_S = 1.0
NO_RETRY = {"x-should-retry": "false"}


class ApiError(web.HTTPException):
    """An OpenAI-shaped error reply."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        self.status_code = status
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
        super().__init__(text=json.dumps(body), content_type="application/json",
                         headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", None, param)


class ChatCompletions:
    """The /v1 handlers over their own micro-batcher (its batches hold callers' requests
    only: chat, and text completions)."""

    def __init__(self, batcher: MicroBatcher, ledger: JobLedger,
                 job_of: Callable[[web.Request], Job]):
        self.batcher, self.ledger, self.job_of = batcher, ledger, job_of
        self._served: dict[str, tuple[float, bool]] = {}  # route -> (checked at, served)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_route("*", "/v1/{tail:.*}", unserved)  # after the served ones

    async def models(self, request: web.Request) -> web.Response:
        self.job_of(request)
        config = get_app().qrq_config
        names = sorted(n for n in {*config.routes, *config.backends} if _servable(n) is None)
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "qrq"} for name in names]})

    async def chat(self, request: web.Request) -> web.Response:
        return await self._relay(request, passthrough.CHAT)

    async def completions(self, request: web.Request) -> web.Response:
        return await self._relay(request, passthrough.COMPLETIONS)

    async def _relay(self, request: web.Request, endpoint: str) -> web.Response:
        """A caller's request to `endpoint` (passthrough.CHAT or COMPLETIONS), validated,
        through the queue to a judge of its route; the judge's reply as it came."""
        job = self.job_of(request)
        body = await _json_object(request)
        route = _route_of(body, endpoint)
        if body.get("stream"):
            raise bad_request("stream: true is not supported: qrq's gateway answers whole "
                              "replies (set stream to false)", "stream")
        CHECKS[endpoint](body)
        try:
            priority = job.priority(request.headers.get(PRIORITY_HEADER))
        except ValueError as exc:
            raise bad_request(f"{PRIORITY_HEADER}: {exc}") from None
        except PermissionError as exc:
            raise ApiError(403, str(exc), "permission_error", "priority_not_allowed") from None
        deadline_s = _deadline(request, get_app().qrq_config.deadline_s)
        if (refusal := self.ledger.refusal(job.name)) is not None:
            raise ApiError(429, refusal, "insufficient_quota", "insufficient_quota",
                           headers=NO_RETRY)
        await self._require_worker(route)
        cache_key = _cache_key(route, endpoint, body)
        if cache_key and (hit := await _cache_get(cache_key)) is not None:
            return _raw(hit, {"x-qrq-cache": "hit"})
        sample = {"prompt": "", "response": "", "extra": {  # a unique "request": never merged
            passthrough.REQUEST: body, passthrough.ENDPOINT: endpoint, "request": uuid.uuid4().hex}}
        try:
            outcome = await asyncio.wait_for(
                self.batcher.score(sample, route.name, priority, deadline_s, job.name),
                deadline_s + GRACE_S)
        except asyncio.TimeoutError:
            raise _deadline_error(deadline_s) from None
        except RedisUnreachable as exc:
            raise ApiError(503, str(exc), "server_error", "redis_unreachable") from None
        if outcome.scored and outcome.detail:
            if cache_key:
                await _cache_put(cache_key, outcome.detail, route.cache_ttl_s)
            return _raw(outcome.detail, {"x-qrq-backend": outcome.backend or ""})
        raise _failure(outcome, deadline_s)

    async def _require_worker(self, route: Route) -> None:
        """503 when no live worker consumes a queue of the route (checked once a second)."""
        app = get_app()
        if app.qrq_config.embedded:
            return
        checked, served = self._served.get(route.name, (0.0, True))
        if time.monotonic() - checked >= LIVENESS_EVERY_S:
            queues = [app.qrq_config.backend(b).queue for b in route.backends]
            try:
                served = await asyncio.to_thread(
                    lambda: any(live_workers(app.store, q) for q in queues))
            except Exception:  # Redis away: the request will say so itself
                served = True
            self._served[route.name] = (time.monotonic(), served)
        if not served:
            raise ApiError(503, f"no live worker serves route {route.name!r} (backends: "
                           f"{', '.join(route.backends)}): start `qrq worker` for one",
                           "server_error", "no_worker", headers={"Retry-After": "5"})


async def unserved(request: web.Request) -> web.Response:
    """Any other /v1 call (`/v1/responses`, embeddings...): a 404 in OpenAI's shape that says
    what is served, not aiohttp's plain-text one a client cannot read."""
    raise ApiError(404, f"{request.method} {request.path} is not served: qrq's gateway serves "
                        "POST /v1/chat/completions, POST /v1/completions and GET /v1/models",
                   "invalid_request_error", "unknown_url")


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")


def _check_prompt(body: dict[str, Any]) -> None:
    """One prompt, as a string or a list of one string: a judge answers one text per call
    (token-id prompts and batches of prompts are not relayed)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' must be a non-empty string (or a list of one string)",
                          "prompt")


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    passthrough.CHAT: _check_messages, passthrough.COMPLETIONS: _check_prompt}


def _servable(name: str, endpoint: str = passthrough.CHAT) -> str | None:
    """Why route `name` cannot take requests to `endpoint`, None when it can."""
    config = get_app().qrq_config
    route = config.route(name)
    if route.votes:
        return f"route {name!r} is an ensemble (votes): it answers scores, not one reply"
    for backend in map(config.backend, route.backends):
        if backend.kind != "judge":
            return f"backend {backend.name!r} of route {name!r} is a {backend.kind}, not a judge"
        if make_backend(backend).grouped:
            return f"judge {backend.name!r} of route {name!r} judges groups (mode = \"group\")"
        dialect = backend.options_as(JudgeOptions).dialect
        if endpoint == passthrough.COMPLETIONS and DIALECTS[dialect].text_path is None:
            return (f"judge {backend.name!r} of route {name!r} speaks the {dialect} "
                    "dialect, which has no text completions (use /v1/chat/completions)")
    return None


def _route_of(body: dict[str, Any], endpoint: str) -> Route:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must name a qrq route (or qrq/<route>)", "model")
    name = model.removeprefix(ROUTE_PREFIX)
    try:
        route = get_app().qrq_config.route(name)
    except UnknownRoute as exc:
        raise ApiError(404, f"model {model!r}: {exc}", "invalid_request_error",
                       "model_not_found", "model") from None
    if (why := _servable(route.name, endpoint)) is not None:
        raise bad_request(f"model {model!r}: {why}", "model")
    return route


def _deadline(request: web.Request, default_s: float) -> float:
    text = request.headers.get(DEADLINE_HEADER)
    if text is None:
        return default_s
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:
        raise bad_request(f"{DEADLINE_HEADER}: expected seconds, from 0 to 86400, got {text!r}")
    return value


def _failure(outcome: Outcome, deadline_s: float) -> ApiError:
    """The error reply for an outcome without a reply (its status and reason)."""
    error = outcome.error or outcome.status
    if outcome.status == "timeout":
        if "no live worker" in error or "no worker" in error:
            return ApiError(503, error, "server_error", "no_worker", headers={"Retry-After": "5"})
        return _deadline_error(deadline_s, error)
    if error.startswith("budget "):
        return ApiError(429, error, "insufficient_quota", "insufficient_quota", headers=NO_RETRY)
    if error.startswith("request rejected with 4"):  # the judge refused the request itself
        return ApiError(400, f"the judge refused the request: {outcome.detail or error}",
                        "invalid_request_error", "rejected_by_judge")
    if error.startswith("invalid sample"):
        return bad_request(error)
    return ApiError(502, f"the judge failed after qrq's retries: {error}", "server_error",
                    "judge_failed", headers=NO_RETRY)


def _deadline_error(deadline_s: float, why: str | None = None) -> ApiError:
    return ApiError(429, why or f"no reply within the request's deadline ({deadline_s:g} s)",
                    "deadline_exceeded", "deadline_exceeded", headers=NO_RETRY)


def _raw(text: str, headers: dict[str, str]) -> web.Response:
    return web.Response(body=text.encode(), content_type="application/json", headers=headers)


def _cache_key(route: Route, endpoint: str, body: dict[str, Any]) -> str | None:
    """The reply cache's key of a request (the route's identity, the endpoint, the body's exact
    content), None when it must not be cached: the route's cache is off, or the temperature
    is not 0."""
    if not route.cache or body.get("temperature") not in (0, 0.0) or body.get("n", 1) != 1:
        return None
    from ..broker.cache import reward_identity

    identity = reward_identity(get_app().qrq_config, route)
    text = json.dumps([endpoint, body], sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    return keys.gateway_reply(identity, digest)


async def _cache_get(key: str) -> str | None:
    try:
        value = await asyncio.to_thread(get_app().store.get, key)
    except Exception:  # the cache is best effort: a miss
        return None
    return value.decode() if isinstance(value, bytes) else None


async def _cache_put(key: str, text: str, ttl_s: float) -> None:
    with contextlib.suppress(Exception):  # best effort: the reply is only not cached
        await asyncio.to_thread(get_app().store.set, key, text.encode(), px=int(ttl_s * 1000))


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        raise bad_request(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body
