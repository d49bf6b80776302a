"""Synchronous client for migd's Unix-socket API (used by migctl and the wrapper)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from migd.errors import DaemonUnavailable, MigdError, ProtocolError, error_from_dict
from migd.protocol import API_VERSION, encode

DEFAULT_SOCKET = Path(os.environ.get("MIGD_API_SOCKET", "/run/migd/migd.sock"))


class MigdClient:
    """One request per connection; replies are decoded into results or migd errors.

    Args:
        socket_path: the daemon's socket (default ``$MIGD_API_SOCKET`` or ``/run/migd/migd.sock``).
        timeout_s: how long to wait for a reply (the ``lease`` call adds its ``wait_s``).
    """

    def __init__(self, socket_path: Path | str | None = None, timeout_s: float = 30.0) -> None:
        self.socket_path = Path(socket_path) if socket_path else DEFAULT_SOCKET
        self.timeout_s = timeout_s
        self._seq = 0

    def call(self, op: str, *, timeout_s: float | None = None, **fields: Any) -> Any:
        """Send one request and return its ``result``.

        Raises:
            DaemonUnavailable: nothing answers on the socket.
            MigdError: the daemon refused the request (the subclass says why).
        """
        self._seq += 1
        message = {"version": API_VERSION, "id": self._seq, "op": op}
        message.update({k: v for k, v in fields.items() if v is not None})
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:  # pragma: no cover - no AF_UNIX
            raise DaemonUnavailable(f"cannot create a socket: {exc}") from exc
        sock.settimeout(timeout_s if timeout_s is not None else self.timeout_s)
        try:
            try:
                sock.connect(str(self.socket_path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise DaemonUnavailable(
                    f"migd is not running (no daemon at {self.socket_path})",
                    hint="start it with `systemctl start migd`, or point --socket at it",
                    socket=str(self.socket_path),
                ) from exc
            except PermissionError as exc:
                raise DaemonUnavailable(
                    f"no permission to connect to {self.socket_path}",
                    hint="ask the admin to allow your user in [api] of migd.toml",
                ) from exc
            # migd may refuse a connection (a limit) before reading the request: read why
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(encode(message))
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except TimeoutError as exc:
            raise DaemonUnavailable(
                f"migd did not answer {op!r} in time", hint="`systemctl status migd`"
            ) from exc
        except OSError as exc:
            if isinstance(exc, MigdError):
                raise
            raise DaemonUnavailable(f"lost the connection to migd: {exc}") from exc
        finally:
            sock.close()
        if not data:
            raise DaemonUnavailable(f"migd closed the connection without answering {op!r}")
        try:
            reply = json.loads(data)
        except ValueError as exc:
            raise ProtocolError(f"unreadable reply from migd: {exc}") from exc
        if reply.get("ok"):
            return reply.get("result")
        raise error_from_dict(reply.get("error") or {})

    # Thin helpers, one per operation.

    def ping(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("ping")
        return result

    def lease(self, *, wait_s: float | None = None, **fields: Any) -> dict[str, Any]:
        timeout = self.timeout_s + (wait_s if wait_s is not None else 86400.0)
        result: dict[str, Any] = self.call("lease", timeout_s=timeout, wait_s=wait_s, **fields)
        return result

    def release(self, lease_id: str, reason: str = "") -> dict[str, Any]:
        result: dict[str, Any] = self.call("release", lease_id=lease_id, reason=reason)
        return result

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("status")
        return result
