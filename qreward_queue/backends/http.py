"""The kinds whose calls are POSTs to `[backend] url`: their option, and what replies teach.

The sockets and the reply parser live in `transport.py`, which only a call or a connect loads.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ScoringError
from ..flow.ratelimit_headers import Feedback
from ..settings import Backend
from ..toml_table import Table, expand_env
from .base import BackendClient, Call

if TYPE_CHECKING:
    from .transport import Reply


class HttpBackend(BackendClient):
    """A kind whose calls are POSTs to `[backend] url`: a kept-alive connection per thread (or
    on the worker's call loop), and replies that teach the limiter by their status and
    rate-limit headers. A kind says what it sends (`request`) and reads (`answer`)."""

    awaitable: ClassVar[bool] = True

    def __init__(self, config: Backend):
        super().__init__(config)
        self.endpoint = config.url or ""

    @classmethod
    def read_options(cls, table: Table) -> dict[str, Any]:
        url = expand_env(table.get("url", str, required=True, expected="an http(s) URL"),
                         table.where("url"))
        if not url.startswith(("http://", "https://")):
            raise table.fail("url", "an http(s) URL")
        return {"url": url}

    def connect(self) -> None:
        """Open the calling thread's kept-alive connection ahead of its first call."""
        from .transport import connect

        connect(self.endpoint, self.config.timeout_s)

    async def connect_async(self) -> None:
        """Open one more kept-alive connection on the call loop ahead of its first call."""
        from .transport import connect_async

        await connect_async(self.endpoint, self.config.timeout_s)

    def call(self, samples: list[dict]) -> Call:
        from .transport import post_json

        return self.answer(samples, post_json(self.config, self.endpoint, self.request(samples)))

    async def call_async(self, samples: list[dict]) -> Call:
        from .transport import post_json_async

        reply = await post_json_async(self.config, self.endpoint, self.request(samples))
        return self.answer(samples, reply)

    @abstractmethod
    def request(self, samples: list[dict]) -> dict:
        """The JSON body of the call that scores `samples`."""

    @abstractmethod
    def answer(self, samples: list[dict], reply: Reply) -> Call:
        """The call's scores, from the decoded 200 reply (PermanentError naming what is wrong
        with a reply that holds none)."""

    def feedback(self, result: Call | ScoringError) -> Feedback:
        """A 2xx answered, a 429 refused for rate; `x-ratelimit-*` and `Retry-After` say the
        limits; `usage.total_tokens` what the call used."""
        return Feedback.from_http(
            result.status_code, result.headers,
            timed_out=isinstance(result, ScoringError) and result.timed_out,
            max_pause_s=self.config.limits.max_pause_s,
            tokens=result.tokens if isinstance(result, Call) else None,
        )
