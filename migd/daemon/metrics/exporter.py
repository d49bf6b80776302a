"""migd's ``/metrics`` endpoint: a small HTTP server (why not prometheus_client's threaded
server: see :mod:`migd.daemon.metrics.service`), and the exposition it serves.

A scrape must never hold up the API, which runs on the daemon's event loop. So the
endpoint has a thread and an event loop of its own: connections are accepted, read,
refused or answered there, and the exposition is encoded there. Only collection runs on
the daemon's loop (it reads the scheduler's books, which only that loop may touch: one
consistent state), handed over with ``run_coroutine_threadsafe``. Scrapes that arrive
while one is being made share its result, and at most ``metrics.max_connections``
connections are served at once (more get 503), so a flood of scrapes costs the daemon's
loop about one collection per wave, and none of the connection handling.

Who may read it: with ``metrics.bearer_token_file`` every request must carry that token
(``Authorization: Bearer``); lease and job ids are labels only with
``metrics.identifying_labels``, which the configuration allows only on a loopback address
with a token (see :class:`migd.daemon.config.MetricsSection`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import os
import stat
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from migd.daemon.config import MetricsSection, MigdConfig
from migd.errors import ConfigError

log = structlog.get_logger("migd.metrics")

Reply = tuple[str, bytes, str, tuple[str, ...]]  # status, body, content type, extra headers


def render(registry: Collector, accept: str = "") -> tuple[bytes, str]:
    """The exposition for an ``Accept`` header: OpenMetrics if asked, else Prometheus text."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


class _Collected(Collector):
    """Families already collected (on the loop), for the encoder to read in its thread."""

    def __init__(self, families: Iterable[Any]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Any]:
        return iter(self.families)


def listen_warnings(config: MigdConfig) -> list[str]:
    """What ``metrics.listen`` exposes that the admin may not mean to (logged at start and
    printed by ``migd --check-config``)."""
    listen = config.metrics.listen
    host = listen.rpartition(":")[0].strip("[]")
    if listen and host in ("0.0.0.0", "::", "*"):
        return [
            f"metrics.listen = {listen!r} serves /metrics on every address of the node "
            "(every network it is on can read it); bind a loopback or management address"
            + ("" if config.metrics.bearer_token_file else ", or set metrics.bearer_token_file")
        ]
    return []


def read_token(section: MetricsSection) -> bytes | None:
    """The bearer token, or None when unset.

    Raises:
        ConfigError: the file is missing, empty, or others may read or write it.
    """
    path = section.bearer_token_file
    if path is None:
        return None
    where = "metrics.bearer_token_file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", where=where) from exc
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if info.st_mode & (stat.S_IROTH | stat.S_IWOTH) or not stat.S_ISREG(info.st_mode):
            raise ConfigError(
                f"{path} is readable by others (mode {stat.S_IMODE(info.st_mode):04o})",
                where=where,
                hint=f"chmod 0600 {path} (0640 with the scraper's group)",
            )
        token = f.read().strip()
    if not token:
        raise ConfigError(f"{path} is empty", where=where, hint="write the token into it")
    return token


class MetricsServer:
    """``GET /metrics`` from a thread of its own (see the module docstring).

    Deliberately minimal HTTP/1.0: one request per connection, a size cap on the request
    head and a timeout, so a stuck or hostile client costs one short-lived task.
    """

    MAX_HEAD = 8192
    TIMEOUT_S = 10.0

    def __init__(self, registry: CollectorRegistry, section: MetricsSection) -> None:
        self.registry = registry
        self.section = section
        host, _, port = section.listen.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self._server: asyncio.Server | None = None
        self._token: bytes | None = None
        self._daemon_loop: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the metrics thread's
        self._thread: threading.Thread | None = None
        self._encoder: concurrent.futures.ThreadPoolExecutor | None = None
        #: The exposition being made, per content type: later scrapes wait for it.
        self._inflight: dict[str, asyncio.Future[tuple[bytes, str]]] = {}
        #: Open connections, and scrapes waiting for another one's exposition.
        self.connections = 0
        self.sharing = 0

    @property
    def bound_port(self) -> int:
        """The port actually bound (``listen`` may name port 0 in tests)."""
        assert self._server is not None and self._server.sockets
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        """Listen, in a thread with its own event loop (see the module docstring).

        Raises:
            ConfigError: a bad token file.
            OSError: the address cannot be bound (a taken port).
        """
        self._token = read_token(self.section)
        self._daemon_loop = asyncio.get_running_loop()
        self._encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="metrics")
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="metrics-http", daemon=True
        )
        self._thread.start()
        try:
            await asyncio.wrap_future(ready)
        except BaseException:
            await asyncio.to_thread(self._thread.join, self.TIMEOUT_S)
            self._thread = None
            self._encoder.shutdown(wait=False)
            self._encoder = None
            raise
        log.info(
            "metrics.listening",
            address=f"{self.host}:{self.bound_port}",
            path="/metrics",
            token=self._token is not None,
            identifying_labels=self.section.identifying_labels,
        )

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        """The metrics thread: accept and answer scrapes until :meth:`close`."""
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def bind() -> None:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)

        try:
            loop.run_until_complete(bind())
        except BaseException as exc:
            loop.close()
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shutdown())
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the aborted transports' connection_lost callbacks

    async def close(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop already closed
            loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, self.TIMEOUT_S)
        self._thread = self._loop = self._server = None
        if self._encoder is not None:
            self._encoder.shutdown(wait=False, cancel_futures=True)
            self._encoder = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.section.max_connections:
            # Refused before anything is collected: a flood costs a read and a write each.
            # The request head is read first (bounded in size and time) so that the close
            # is a clean end of stream and the client sees the 503, not a reset.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 1.0)
            await self._reply(writer, self._busy())
            return
        self.connections += 1
        try:
            await self._serve_one(reader, writer)
        finally:
            self.connections -= 1
            writer.transport.abort()  # already closed, or cancelled by close()

    def _busy(self) -> Reply:
        body = (
            f"busy: {self.connections} metrics connections open "
            f"(metrics.max_connections = {self.section.max_connections}); retry later\n"
        ).encode()
        return "503 Service Unavailable", body, "text/plain", ("Retry-After: 1",)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reply: Reply
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.TIMEOUT_S)
            reply = await self._answer(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            reply = "400 Bad Request", b"bad request\n", "text/plain", ()
        except ConnectionError:
            writer.close()
            return
        except Exception as exc:  # a collector bug must not take the daemon down
            log.exception("metrics.collect_failed", error=str(exc))
            reply = "500 Internal Server Error", b"error\n", "text/plain", ()
        await self._reply(writer, reply)

    async def _reply(self, writer: asyncio.StreamWriter, reply: Reply) -> None:
        status, body, content_type, extra = reply
        header = (
            f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n"
            + "".join(f"{h}\r\n" for h in extra)
            + "Connection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(ConnectionError):
            writer.write(header + body)
            await asyncio.wait_for(writer.drain(), self.TIMEOUT_S)
        if not writer.is_closing():
            writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), self.TIMEOUT_S)
        writer.transport.abort()  # a client that never read its reply keeps nothing

    async def _answer(self, head: bytes) -> Reply:
        if len(head) > self.MAX_HEAD:
            return "431 Request Header Fields Too Large", b"too large\n", "text/plain", ()
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3:
            return "400 Bad Request", b"bad request\n", "text/plain", ()
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"GET /metrics\n", "text/plain", ()
        if target.split("?", 1)[0] not in ("/metrics", "/"):
            return "404 Not Found", b"migd serves /metrics\n", "text/plain", ()
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if self._token is not None:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode("latin-1"), self._token
            ):
                body = b"a bearer token is required (metrics.bearer_token_file)\n"
                return (
                    "401 Unauthorized",
                    body,
                    "text/plain",
                    ('WWW-Authenticate: Bearer realm="migd"',),
                )
        body, content_type = await self._exposition(headers.get("accept", ""))
        return "200 OK", b"" if method == "HEAD" else body, content_type, ()

    async def _exposition(self, accept: str) -> tuple[bytes, str]:
        """The exposition, shared with every scrape that asks while it is being made."""
        _, content_type = choose_encoder(accept)
        fut = self._inflight.get(content_type)
        shared = fut is not None
        if fut is None:
            fut = asyncio.ensure_future(self._render(accept))
            self._inflight[content_type] = fut

            def done(f: asyncio.Future[tuple[bytes, str]], key: str = content_type) -> None:
                if self._inflight.get(key) is f:
                    del self._inflight[key]

            fut.add_done_callback(done)
        else:
            self.sharing += 1
        try:
            return await asyncio.shield(fut)
        finally:
            if shared:
                self.sharing -= 1

    async def _render(self, accept: str) -> tuple[bytes, str]:
        # Collection reads the scheduler: on the daemon's loop, for one consistent state.
        # Encoding only reads what was collected: here, in the metrics thread.
        assert self._daemon_loop is not None
        collected = asyncio.run_coroutine_threadsafe(self._collect(), self._daemon_loop)
        families = await asyncio.wait_for(asyncio.wrap_future(collected), self.TIMEOUT_S)
        # In a worker of this thread's loop, which keeps accepting (and refusing) meanwhile.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._encoder, render, families, accept)

    async def _collect(self) -> _Collected:
        return _Collected(self.registry.collect())
