"""sd_notify without libsystemd: READY, WATCHDOG, STATUS, RELOADING, STOPPING.

A no-op outside systemd (no ``NOTIFY_SOCKET``). The watchdog interval comes from
``WATCHDOG_USEC`` and applies only if ``WATCHDOG_PID`` is unset or ours, as
sd_watchdog_enabled(3) specifies.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace
        self.address = address or None
        self.watchdog_s: float | None = None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if usec and usec.isdigit() and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1_000_000

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        if not self.address:
            return False
        message = "\n".join(fields).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            # Never block the event loop on a slow or stuck notify peer (sd_notify(3)
            # sends with MSG_DONTWAIT too): a dropped WATCHDOG=1 is retried next tick.
            sock.setblocking(False)
            try:
                sock.connect(self.address)
                sock.send(message)
            except OSError:
                return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def reloading(self) -> bool:
        return self.notify("RELOADING=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")
