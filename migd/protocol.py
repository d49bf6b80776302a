"""The wire format's constants and framing, without pydantic.

Clients (``migctl``, the wrapper, the release hook) import this module instead of
:mod:`migd.api`, whose pydantic models cost ~0.2 s of start-up that a short-lived
``migctl status`` should not pay. :mod:`migd.api` re-exports everything here.
"""

from __future__ import annotations

import json
from typing import Any

API_VERSION = 1
MAX_NESTING = 32  # deepest JSON nesting a request may have (objects and arrays)


def encode(obj: dict[str, Any]) -> bytes:
    """One message: compact JSON and a newline."""
    return json.dumps(obj, separators=(",", ":"), default=str).encode() + b"\n"


__all__ = ["API_VERSION", "MAX_NESTING", "encode"]
