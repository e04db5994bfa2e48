"""Where qrq's Redis configuration becomes connections: a plain URL or a Sentinel group.

Every Redis user (Celery's broker and result backend, the limiter, cache, liveness, breaker,
dead letters, the client's polls, `qrq status`, the exporter) connects through here, so a
Sentinel deployment follows a failover everywhere at once: each connection asks the
sentinels for the current primary when it (re)connects, a primary demoted to replica is
dropped on its first READONLY reply (redis-py's `SentinelManagedConnection`), and a connection
idle past its health check asks the sentinels again before it is used (`Following*`): a frozen
primary that comes back still says it is the primary for seconds, until they demote it.

The URL form is Celery's: `sentinel://[:pw@]h1:26379;sentinel://h2:26379/0`, the service
(master) name coming from `[redis] service_name` or `QRQ_REDIS_SERVICE_NAME`, as Celery takes
it from the `master_name` transport option.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard
from urllib.parse import quote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelConnection
from redis.sentinel import Sentinel, SentinelManagedConnection

from ..errors import RedisUnreachable
from ..redact import redact_url

if TYPE_CHECKING:
    from .model import Config

SCHEME = "sentinel"
SEPARATOR = ";"  # between the sentinels of one URL, as kombu and Celery split it
DEFAULT_SENTINEL_PORT = 26379
SERVICE_ENV = "QRQ_REDIS_SERVICE_NAME"
SENTINEL_TIMEOUT_S = 2.0  # one sentinel's answer; the next one is asked after this


class FollowingConnection(SentinelManagedConnection):
    """A primary's connection that, used after an idle spell past its health check, first asks
    the sentinels whether its server is still the primary and reconnects to the one they name
    if not. Without this a pooled (or pub/sub) connection to a primary that froze and came back
    works on it: it answers PING and says it is the primary until the sentinels demote it."""

    _confirmed = 0.0  # when (monotonic) the sentinels were last asked about this server

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        now = time.monotonic()
        if (self._sock is not None and self.health_check_interval
                and now > max(self.next_health_check, self._confirmed + self.health_check_interval)
                and self.connection_pool.is_master):
            self._confirmed = now  # the health check's own PING comes through here too
            if self.connection_pool.get_master_address() != (self.host, self.port):
                self.disconnect()
                self.connect()
        super().send_packed_command(command, check_health)


class AsyncFollowingConnection(AsyncSentinelConnection):
    """`FollowingConnection` for redis-py's asyncio client."""

    async def check_health(self) -> None:
        if (self.health_check_interval
                and asyncio.get_running_loop().time() > self.next_health_check
                and self.connection_pool.is_master
                and await self.connection_pool.get_master_address() != (self.host, self.port)):
            await self.disconnect()
            await self.connect()
        await super().check_health()


def is_sentinel(url: str | None) -> TypeGuard[str]:
    return url is not None and url.startswith(f"{SCHEME}://")


def sentinel_url(addresses: Sequence[str], db: int = 0) -> str:
    """Celery's URL for `["host:port", ...]` (the form `[redis] sentinels` takes)."""
    return SEPARATOR.join(f"{SCHEME}://{a}/{db}" for a in addresses)


def sentinel_addresses(url: str) -> list[tuple[str, int]]:
    """(host, port) of every sentinel in a `sentinel://...;sentinel://.../db` URL."""
    out = []
    for chunk in url.split(SEPARATOR):
        parts = urlsplit(chunk.strip())
        if parts.scheme != SCHEME or not parts.hostname:
            raise ValueError(f"{chunk!r} is not sentinel://host[:port]")
        out.append((parts.hostname, parts.port or DEFAULT_SENTINEL_PORT))
    return out


def sentinel_db(url: str) -> int:
    """The database number: the first path in the URL (Celery's docs write it on every
    sentinel, `sentinel://h1:26379/0;sentinel://h2:26379/0`, and also show it on the last)."""
    for chunk in url.split(SEPARATOR):
        path = urlsplit(chunk.strip()).path.strip("/")
        if path:
            return int(path)
    return 0


def _url(config: Config) -> str:
    """The Redis URL of a config that has Redis (an embedded one has none to connect to)."""
    if config.redis_url is None:
        raise ValueError("an embedded configuration has no Redis to connect to")
    return config.redis_url


def _env(name: str | None) -> str | None:
    return os.environ.get(name) or None if name else None


def _with_password(url: str, password: str | None) -> str:
    """`url` with `password` in every `;` part lacking one (Celery takes it only there)."""
    if not password:
        return url
    chunks = []
    for chunk in url.split(SEPARATOR):
        parts = urlsplit(chunk)
        if parts.password is None and parts.hostname:
            host = parts.netloc.rpartition("@")[2]
            netloc = f"{quote(parts.username or '', safe='')}:{quote(password, safe='')}@{host}"
            chunk = parts._replace(netloc=netloc).geturl()
        chunks.append(chunk)
    return SEPARATOR.join(chunks)


def _sentinel_kwargs(config: Config) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_S,
                              "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    password = _env(config.sentinel_password_env)
    if password:
        kwargs["password"] = password
    return kwargs


def _sentinel(config: Config, kind: type[Any] = Sentinel, **connection: Any) -> Any:
    url = _url(config)
    first = urlsplit(url.split(SEPARATOR)[0])  # where Celery reads them too
    if first.username:
        connection["username"] = first.username
    password = _env(config.redis_password_env) or first.password
    if password:
        connection["password"] = password
    return kind(
        sentinel_addresses(url),
        sentinel_kwargs=_sentinel_kwargs(config),
        db=sentinel_db(url),
        **connection,
    )


def connect(config: Config, **connection: Any) -> redis.Redis:
    """A client of the current primary (`connection`: redis-py options such as timeouts)."""
    return _connect(config, redis.Redis, Sentinel, FollowingConnection, connection)


def connect_async(config: Config, **connection: Any) -> redis.asyncio.Redis:
    """`connect` for an event loop (redis-py's asyncio client, bound to the loop using it)."""
    return _connect(config, redis.asyncio.Redis, redis.asyncio.sentinel.Sentinel,
                    AsyncFollowingConnection, connection)


def _connect(config: Config, plain: type[Any], sentinel: type[Any], follower: type[Any],
             connection: dict[str, Any]) -> Any:
    if not is_sentinel(config.redis_url):
        password = _env(config.redis_password_env)
        if password:
            connection["password"] = password
        return plain.from_url(_url(config), **connection)
    return _sentinel(config, sentinel, **connection).master_for(
        config.redis_service_name, connection_class=follower)


def celery_settings(config: Config, transport: dict[str, Any],
                    result_transport: dict[str, Any]) -> dict[str, Any]:
    """Broker and result-backend settings for `config`, Sentinel options included."""
    url = _with_password(_url(config), _env(config.redis_password_env))
    if not is_sentinel(url):
        return {
            "broker_url": url,
            "result_backend": f"qreward_queue.broker.results:QrqRedisBackend+{url}",
            "broker_transport_options": transport,
            "result_backend_transport_options": result_transport,
        }
    sentinel = {"master_name": config.redis_service_name,
                "sentinel_kwargs": _sentinel_kwargs(config)}
    # kombu and Celery's backend read the database from the first sentinel's path: put it on each
    db = sentinel_db(url)
    url = SEPARATOR.join(urlsplit(c)._replace(path=f"/{db}").geturl() for c in url.split(SEPARATOR))
    return {
        "broker_url": url,
        "result_backend": f"qreward_queue.broker.results:QrqSentinelBackend+{url}",
        "broker_transport_options": {**transport, **sentinel},
        "result_backend_transport_options": {**result_transport, **sentinel},
    }


def describe(config: Config) -> str:
    """Where Redis is, without passwords (for messages and logs)."""
    if not is_sentinel(config.redis_url):
        return redact_url(config.redis_url or "")
    nodes = ", ".join(f"{h}:{p}" for h, p in sentinel_addresses(config.redis_url))
    return f"service {config.redis_service_name!r} via sentinels {nodes}"


def sentinel_problem(config: Config) -> str | None:
    """Why no primary can be found through the sentinels, in one line (None: one is found)."""
    sentinel = _sentinel(config, socket_timeout=SENTINEL_TIMEOUT_S)
    errors, known = [], set()
    try:
        for node in sentinel.sentinels:
            where = "{host}:{port}".format(**node.connection_pool.connection_kwargs)
            try:
                masters = node.sentinel_masters()
            except redis.RedisError as exc:
                errors.append(f"{where}: {str(exc).strip() or type(exc).__name__}")
                continue
            if config.redis_service_name in masters:
                return None
            known.update(masters)
    finally:
        for node in sentinel.sentinels:
            node.close()
    nodes = ", ".join(f"{h}:{p}" for h, p in sentinel_addresses(_url(config)))
    if not known and len(errors) == len(sentinel.sentinels):
        return (f"no sentinel answered at {nodes} ({'; '.join(errors)}): check that "
                "redis-sentinel runs there and that [redis] sentinels / QRQ_REDIS_URL name it")
    return (f"the sentinels at {nodes} know no service named {config.redis_service_name!r} "
            f"(they know: {', '.join(sorted(known)) or 'none'}): check [redis] service_name "
            f"or {SERVICE_ENV}")


def describe_mode(config: Config) -> str:
    """One line saying which mode runs (and where Redis is, without its password)."""
    if config.embedded:
        return (
            "qrq: embedded mode (in-memory broker, in-process workers; "
            "set QRQ_REDIS_URL for distributed mode)"
        )
    return f"qrq: distributed mode (Redis at {describe(config)})"


def redis_problem(config: Config, exc: Exception) -> str:
    """One line saying what went wrong with Redis and what to check."""
    if is_sentinel(config.redis_url):
        problem = sentinel_problem(config)
        if problem:
            return problem
    where, why = describe(config), str(exc).strip() or type(exc).__name__
    if "DB index is out of range" in why:
        return (
            f"Redis at {where} has no such database ({why}): use a database number below the "
            "server's `databases` setting (16 unless redis.conf says otherwise)"
        )
    if isinstance(exc, redis.AuthenticationError) or "NOAUTH" in why or "WRONGPASS" in why:
        return f"Redis at {where} refused the credentials ({why}): check the password in the URL"
    origin = (
        "QRQ_REDIS_URL" if os.environ.get("QRQ_REDIS_URL") else f"[redis] url in {config.source}"
    )
    return (
        f"cannot reach Redis at {where} ({why}): check that redis-server runs there "
        f"and that {origin} names it"
    )


def check_redis(config: Config) -> None:
    """Fail fast, in one line, when distributed mode cannot reach (or select) its database."""
    if config.embedded:
        return
    client = connect(config, socket_connect_timeout=3, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RedisUnreachable(redis_problem(config, exc)) from None
    finally:
        client.close()
