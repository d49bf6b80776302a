"""A small progress bar on stderr (no dependencies).

On a terminal it redraws one line, also within a long step (:meth:`ProgressBar.partial`);
otherwise (CI logs, pipes), when enabled explicitly, it prints a line at every tenth
of the way so logs stay short.
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
        self._last_draw = 0.0

    def update(self, steps: int = 1, note: str = "") -> None:
        """Advance by ``steps`` and redraw, with an optional note (e.g. the policy)."""
        self.done = min(self.total, self.done + steps)
        if not self.enabled:
            return
        if self.tty:
            self._draw(self.done, note)
            return
        decile = int(self.done / self.total * 10)
        if decile != self._last_decile or self.done == self.total:
            self._last_decile = decile
            self.stream.write(self._text(self.done, note) + "\n")
            self.stream.flush()

    def partial(self, fraction: float, note: str = "") -> None:
        """Show progress *within* the current step (``fraction`` of it done).

        Only on a terminal, at most every 0.1 s: logs get the per-step lines only.
        """
        if not (self.enabled and self.tty):
            return
        now = time.monotonic()
        if now - self._last_draw < 0.1:
            return
        self._draw(min(float(self.total), self.done + max(0.0, min(1.0, fraction))), note)

    def _text(self, position: float, note: str) -> str:
        frac = position / self.total
        elapsed = time.monotonic() - self._started
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        filled = round(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        count = f"{position:.0f}" if position == int(position) else f"{position:.1f}"
        return f"{self.label} [{bar}] {count}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {note}"

    def _draw(self, position: float, note: str) -> None:
        self._last_draw = time.monotonic()
        self.stream.write("\r" + self._text(position, note)[:160].ljust(100))
        self.stream.flush()

    def close(self) -> None:
        """Finish the line (terminal) so later output starts cleanly."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
