"""A small progress bar on stderr (no dependencies).

On a terminal it redraws one line; otherwise (CI logs, pipes) it prints a line
at every tenth of the way so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Progress of ``total`` steps.

    Args:
        total: number of steps (at least 1 is assumed).
        label: what is being done, shown before the bar.
        stream: where to write (default ``sys.stderr``).
        enabled: ``False`` writes nothing; ``None`` writes when ``stream`` is a terminal
            or when ``force`` was given.
        width: characters of the bar.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        width: int = 28,
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = self.tty if enabled is None else enabled
        self.width = width
        self.done = 0
        self._started = time.monotonic()
        self._last_decile = -1

    def update(self, steps: int = 1, note: str = "") -> None:
        """Advance by ``steps`` and redraw, with an optional note (e.g. the policy)."""
        self.done = min(self.total, self.done + steps)
        if not self.enabled:
            return
        frac = self.done / self.total
        elapsed = time.monotonic() - self._started
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        filled = round(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        text = (
            f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {note}"
        )
        if self.tty:
            self.stream.write("\r" + text[:160].ljust(100))
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile != self._last_decile or self.done == self.total:
                self._last_decile = decile
                self.stream.write(text + "\n")
                self.stream.flush()

    def close(self) -> None:
        """Finish the line (terminal) so later output starts cleanly."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
