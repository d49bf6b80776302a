"""migd's ``/metrics`` endpoint: a small HTTP server on the daemon's own event loop (why not
prometheus_client's threaded server: see :mod:`migd.daemon.metrics`), and the exposition it
serves.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = structlog.get_logger("migd.metrics")


def render(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """The exposition for an ``Accept`` header: OpenMetrics if asked, else Prometheus text."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


class MetricsServer:
    """``GET /metrics`` on the daemon's event loop (see the module docstring).

    Deliberately minimal HTTP/1.0: one request per connection, a size cap on the request
    head and a timeout, so a stuck or hostile client costs one short-lived task.
    """

    MAX_HEAD = 8192
    TIMEOUT_S = 10.0

    def __init__(self, registry: CollectorRegistry, listen: str) -> None:
        self.registry = registry
        host, _, port = listen.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self._server: asyncio.Server | None = None

    @property
    def bound_port(self) -> int:
        """The port actually bound (``listen`` may name port 0 in tests)."""
        assert self._server is not None and self._server.sockets
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        log.info("metrics.listening", address=f"{self.host}:{self.bound_port}", path="/metrics")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.TIMEOUT_S)
            status, body, content_type = self._answer(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, body, content_type = "400 Bad Request", b"bad request\n", "text/plain"
        except ConnectionError:
            writer.close()
            return
        except Exception as exc:  # a collector bug must not take the daemon down
            log.exception("metrics.collect_failed", error=str(exc))
            status, body, content_type = "500 Internal Server Error", b"error\n", "text/plain"
        header = (
            f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(ConnectionError):
            writer.write(header + body)
            await writer.drain()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[str, bytes, str]:
        if len(head) > self.MAX_HEAD:
            return "431 Request Header Fields Too Large", b"too large\n", "text/plain"
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3:
            return "400 Bad Request", b"bad request\n", "text/plain"
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        if target.split("?", 1)[0] not in ("/metrics", "/"):
            return "404 Not Found", b"migd serves /metrics\n", "text/plain"
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        body, content_type = render(self.registry, accept)
        return "200 OK", b"" if method == "HEAD" else body, content_type
