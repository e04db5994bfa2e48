"""`qrq gateway`: remote-RM HTTP endpoints for OpenRLHF and slime, and an OpenAI-compatible
front door (openai_gateway.py), micro-batched onto qrq.

    POST /get_reward   OpenRLHF: {"query": [...], "prompts": [...], "labels": [...]}
                       -> {"rewards": [...], "scores": [...], "extra_logs": {"qrq_ok": [...]}}
    POST /slime        slime --rm-type remote_rm: {"prompt", "response", "label"} -> a number
    GET  /health       {"status": "ok", "mode": "distributed" | "embedded", "pending": samples
                        waiting, "batches_sent": batches sent so far}
    POST /v1/chat/completions, POST /v1/completions, GET /v1/models   see openai_gateway.py

Callers: with `[gateway]` keys configured (gateway_keys.py) every endpoint but /health needs
`Authorization: Bearer <key>` (a wrong one is a 401) and a request runs at a priority its key
allows (`X-Qrq-Priority`, slime's `qrq_priority` mark; another is a 403). With none, every
caller is one job, `default`, so `qrq gateway` binds 127.0.0.1 unless told otherwise.

Both trainers send one sample per request and retry any non-2xx, and neither survives a
missing reward, so every well-formed request is answered 200 with a number by its deadline
(150 s for OpenRLHF's 180 s client timeout, 100 s for slime's 120 s): what qrq could not
score comes back as the fallback score with `qrq_ok = 0`. Malformed bodies get a 400 naming
the field. Concurrent requests share the process's micro-batcher, so they reach the queue
as batches. Responses carry scores and statuses only, never configuration or keys.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from ..background import new_event_loop
from ..ops.job_spend import FLUSH_EVERY_S, JobLedger
from ..priority import Priority
from ..samples import Outcome
from ..trainer.batcher import MicroBatcher
from ..trainer.runtime import get_app
from .coerce import make_sample
from .gateway_keys import Job, Keys
from .openai_gateway import PRIORITY_HEADER, ApiError, ChatCompletions
from .openrlhf import DEADLINE_S as OPENRLHF_DEADLINE_S
from .openrlhf import reply, samples_of

SLIME_DEADLINE_S = 100.0
GRACE_S = 5.0  # answer this long after the qrq deadline at the latest, whatever happens


class BadRequest(ValueError):
    """A request body the gateway cannot read; the message names the field."""


class Gateway:
    """The HTTP handlers over one route (the RM endpoints'), the callers' keys and two
    MicroBatchers: the RM endpoints' and the chat requests' (never mixed in one batch)."""

    def __init__(self, route: str | None = None, batcher: MicroBatcher | None = None,
                 openrlhf_deadline_s: float = OPENRLHF_DEADLINE_S,
                 slime_deadline_s: float = SLIME_DEADLINE_S, keys: Keys | None = None,
                 chat_batcher: MicroBatcher | None = None):
        self.route, self.batcher = route, batcher or MicroBatcher()
        self.openrlhf_deadline_s, self.slime_deadline_s = openrlhf_deadline_s, slime_deadline_s
        self.keys = keys or Keys({})
        app = get_app()
        self.ledger = JobLedger(None if app.qrq_config.embedded else app.store, app.qrq_config)
        self.chat = ChatCompletions(
            chat_batcher or MicroBatcher(self.batcher.max_items, self.batcher.max_wait_s * 1000,
                                         max_in_flight=self.batcher.max_in_flight),
            self.ledger, _job)
        self.pending = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20, middlewares=[self.authenticate])
        app.router.add_post("/get_reward", self.openrlhf)
        app.router.add_post("/slime", self.slime)
        app.router.add_get("/health", self.health)
        self.chat.add_routes(app)
        app.cleanup_ctx.append(self._flushing)
        return app

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The caller's job (`request["qrq_job"]`) from its key; 401 for a wrong one."""
        if request.path != "/health":
            job = self.keys.job(request.headers.get("Authorization"))
            if job is None:
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                               "invalid_request_error", "invalid_api_key")
            request["qrq_job"] = job
        return await handler(request)

    async def _flushing(self, _: web.Application) -> Any:
        """The jobs' spend written (and budgets read) every FLUSH_EVERY_S while serving."""
        async def flush_forever() -> None:
            while True:
                await asyncio.sleep(FLUSH_EVERY_S)
                await asyncio.to_thread(self.ledger.flush)

        task = asyncio.create_task(flush_forever())
        yield
        task.cancel()
        await asyncio.to_thread(self.ledger.flush)

    async def openrlhf(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        try:
            queries, prompts = _strings(body, "query"), _strings(body, "prompts")
            labels = body.get("labels")
            if len(prompts) != len(queries) or (labels is not None and len(labels) != len(queries)):
                raise BadRequest("'query', 'prompts' and 'labels' must have the same length")
            samples = samples_of(queries, prompts, labels)
        except (BadRequest, TypeError) as exc:
            raise web.HTTPBadRequest(text=f"bad OpenRLHF request: {exc}") from None
        priority = _priority(request, request.headers.get(PRIORITY_HEADER))
        outcomes = await self.score(samples, self.openrlhf_deadline_s, priority)
        return web.json_response(reply(outcomes))

    async def slime(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        for key in ("prompt", "response"):
            if key not in body:
                raise web.HTTPBadRequest(text=f"bad slime request: missing field '{key}'")
        sample = make_sample(body["prompt"], body["response"], body.get("label"))
        marked = Priority.marked((body.get("metadata") or {}).get("qrq_priority"))
        asked = request.headers.get(PRIORITY_HEADER) or \
            (marked.value if marked is Priority.VAL else None)
        priority = _priority(request, asked)
        [outcome] = await self.score([sample], self.slime_deadline_s, priority)
        return web.json_response(outcome.reward)

    async def health(self, _: web.Request) -> web.Response:
        mode = "embedded" if get_app().qrq_config.embedded else "distributed"
        return web.json_response({"status": "ok", "mode": mode, "pending": self.pending,
                                  "batches_sent": self.batcher.batches_sent})

    async def score(self, samples: Sequence[dict], deadline_s: float,
                    priority: Priority | str = Priority.TRAIN) -> list[Outcome]:
        """Outcomes by deadline_s (+ grace) at the latest; failures become fallback outcomes."""
        self.pending += len(samples)
        try:
            return await asyncio.wait_for(
                self.batcher.score_many(samples, self.route, priority, deadline_s),
                deadline_s + GRACE_S,
            )
        except asyncio.TimeoutError:
            return _fallbacks(len(samples), "timeout", f"no outcome within {deadline_s} s")
        except Exception as exc:  # Redis down, unknown route...: still a number, with the reason
            return _fallbacks(len(samples), "error", f"{type(exc).__name__}: {exc}")
        finally:
            self.pending -= len(samples)


def _job(request: web.Request) -> Job:
    job: Job = request["qrq_job"]
    return job


def _priority(request: web.Request, asked: str | None) -> Priority:
    """The priority `asked` for, if the caller's key allows it (400 / 403 if not)."""
    try:
        return _job(request).priority(asked)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"{PRIORITY_HEADER}: {exc}") from None
    except PermissionError as exc:
        raise web.HTTPForbidden(text=str(exc)) from None


def _fallbacks(n: int, status: Any, why: str) -> list[Outcome]:
    fallback = get_app().qrq_config.fallback_score
    return [Outcome(fallback, status, error=why) for _ in range(n)]


async def _json_object(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=f"request body must be a JSON object, got "
                                      f"{type(body).__name__}")
    return body


def _strings(body: dict, key: str) -> list[str]:
    value = body.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"field '{key}' must be a list of strings")
    return value


def serve(host: str, port: int, gateway: Gateway) -> None:
    """Run the gateway until interrupted."""
    web.run_app(gateway.app(), host=host, port=port, print=None, access_log=None,
                loop=new_event_loop())
