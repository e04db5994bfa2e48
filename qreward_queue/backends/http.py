"""The kinds whose calls are POSTs to `[backend] url`: their option, and what replies teach.

The sockets and the reply parser live in `transport.py`, which only a call or a connect loads.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..config.model import Backend, KindOptions
from ..config.toml_table import Table, expand_env, read_fields
from ..errors import ConfigError, ScoringError
from ..flow.ratelimit_headers import Feedback
from ..redact import redact_url
from .base import BackendClient, Call
from .dialects import AUTH_SCHEMES, DIALECTS, Dialect

if TYPE_CHECKING:
    from .transport import Reply


_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP header name
_FRAMING = ("host", "content-length", "content-type", "transfer-encoding", "connection")


def _pairs(table: Table, key: str, defaults: tuple[tuple[str, str], ...]
           ) -> tuple[tuple[str, str], ...]:
    """`key = { name = "value", ... }` (values may name `${VAR}`s, read at call time) after
    the dialect's `defaults` that the file does not set itself."""
    given = table.get(key, dict, {}, expected='a table of names = "text values"')
    for name, value in given.items():  # the value is not shown: it may be a pasted key
        if not isinstance(value, str) or "\n" in value or "\r" in value:
            raise ConfigError(f"{table.where(key)}.{name}: expected a text value on one line "
                              '(a secret as "${VAR}", the NAME of its environment variable)')
    named = {name.lower() for name in given}
    return tuple((n, v) for n, v in defaults if n.lower() not in named) + tuple(given.items())


@dataclass(frozen=True, kw_only=True)
class HttpOptions(KindOptions):
    """How a provider wants its calls (dialects.py, transport.py): the keys every kind that
    POSTs to `url` reads."""

    url: str  # ${VAR} filled when the file loads
    dialect: str = "openai"  # openai | anthropic | azure: the request and reply shapes
    auth: str = "bearer"  # how the API key is sent: bearer | api-key | x-api-key | none
    headers: tuple[tuple[str, str], ...] = ()  # extra headers; ${VAR} read at call time
    query: tuple[tuple[str, str], ...] = ()  # query parameters; ${VAR} read at call time
    proxy: str | None = None  # an http:// proxy; "": none; None: HTTPS_PROXY/HTTP_PROXY/NO_PROXY
    ca_file: str | None = None  # the CA that signs the server's certificate (a private judge)
    verify: bool = True  # False only when a file says so; the worker warns at start

    def call_time_values(self) -> tuple[tuple[str, str, str], ...]:
        return tuple((table, key, value) for table, pairs in
                     (("headers", self.headers), ("query", self.query)) for key, value in pairs)


class HttpBackend(BackendClient):
    """A kind whose calls are POSTs to `[backend] url`: a kept-alive connection per thread (or
    on the worker's call loop), and replies that teach the limiter by their status and
    rate-limit headers. A kind says what it sends (`request`) and reads (`answer`)."""

    awaitable: ClassVar[bool] = True
    Options: ClassVar[type[KindOptions]] = HttpOptions

    def __init__(self, config: Backend):
        super().__init__(config)
        self.http = config.options_as(HttpOptions)
        self.endpoint = self.http.url

    @classmethod
    def read_options(cls, table: Table) -> KindOptions:
        return read_fields(table, cls.Options, **cls.read_http(table))

    @classmethod
    def read_http(cls, table: Table) -> dict[str, Any]:
        """The keys of `HttpOptions`, checked (a URL, headers qrq can send, a CA file...)."""
        url = expand_env(table.get("url", str, required=True, expected="an http(s) URL"),
                         table.where("url"))
        if not url.startswith(("http://", "https://")):
            raise table.fail("url", "an http(s) URL")
        dialect = cls.read_dialect(table)
        auth = table.get("auth", str, dialect.auth, expected=f"one of {', '.join(AUTH_SCHEMES)}")
        if auth not in AUTH_SCHEMES:
            raise table.fail("auth", f"one of {', '.join(AUTH_SCHEMES)}")
        headers = _pairs(table, "headers", dialect.headers)
        for name, _ in headers:
            if not _TOKEN.fullmatch(name) or name.lower() in _FRAMING:
                raise ConfigError(f"{table.where('headers')}: {name!r} is not a header qrq can "
                                  f"send (a name of letters, digits and !#$%&'*+-.^_`|~; not "
                                  f"one of {', '.join(_FRAMING)})")
        proxy = table.get("proxy", str, None, expected='an http://host:port URL, or "" for none')
        if proxy:
            proxy = expand_env(proxy, table.where("proxy"))
            if not proxy.startswith("http://"):  # shown without its password
                raise ConfigError(f"{table.where('proxy')}: expected an http://host:port URL, "
                                  f'or "" for none, got {redact_url(proxy)!r}')
        ca_file = table.get("ca_file", str, None, expected="the path of a PEM file")
        if ca_file is not None:
            path = Path(table.source).parent / Path(ca_file).expanduser()
            if not path.is_file():
                raise table.fail("ca_file", f"a PEM file (no file {path})")
            ca_file = str(path.resolve())
        return {"url": url, "dialect": dialect.name, "auth": auth, "headers": headers,
                "query": _pairs(table, "query", dialect.query), "proxy": proxy,
                "ca_file": ca_file, "verify": table.get("verify", bool, True)}

    @classmethod
    def read_dialect(cls, table: Table) -> Dialect:
        """The provider's shape (`dialects.py`); a kind with a wire format of its own has one."""
        return DIALECTS["openai"]

    def preflight(self) -> list[str]:
        notes = super().preflight()
        if not self.http.verify:
            notes.append(f"warning: {self.config.source}: backend.verify = false: the TLS "
                         f"certificate of backend {self.config.name!r} is not checked (anyone on "
                         "the way can read and change its calls); trust its CA with ca_file "
                         "instead")
        return notes

    def connect(self) -> None:
        """Open the calling thread's kept-alive connection ahead of its first call."""
        from .transport import connect

        connect(self.config, self.endpoint)

    async def connect_async(self) -> None:
        """Open one more kept-alive connection on the call loop ahead of its first call."""
        from .transport import connect_async

        await connect_async(self.config, self.endpoint)

    def call(self, samples: list[dict]) -> Call:
        from .transport import post_json

        reply = post_json(self.config, self.url(samples), self.request(samples))
        return self.answer(samples, reply)

    async def call_async(self, samples: list[dict]) -> Call:
        from .transport import post_json_async

        reply = await post_json_async(self.config, self.url(samples), self.request(samples))
        return self.answer(samples, reply)

    def url(self, samples: list[dict]) -> str:
        """Where the call that scores `samples` goes (one server for every call)."""
        return self.endpoint

    @abstractmethod
    def request(self, samples: list[dict]) -> dict:
        """The JSON body of the call that scores `samples`."""

    @abstractmethod
    def answer(self, samples: list[dict], reply: Reply) -> Call:
        """The call's scores, from the decoded 200 reply (PermanentError naming what is wrong
        with a reply that holds none)."""

    def feedback(self, result: Call | ScoringError) -> Feedback:
        """A 2xx answered, a 429 (or Anthropic's 529) refused for rate; `x-ratelimit-*` (or
        `anthropic-ratelimit-*`) and `Retry-After` say the limits; `usage` what the call used."""
        return Feedback.from_http(
            result.status_code, result.headers,
            timed_out=isinstance(result, ScoringError) and result.timed_out,
            max_pause_s=self.config.limits.max_pause_s,
            tokens=result.tokens if isinstance(result, Call) else None,
        )
