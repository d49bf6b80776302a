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


class DuplicateKeyError(ValueError):
    """A JSON object names the same key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise DuplicateKeyError(f"key {key!r} appears more than once in one object")
        obj[key] = value
    return obj


def decode(line: bytes | str) -> Any:
    """Parse one message, refusing an object that names a key twice.

    Python's json keeps the last of duplicate keys, so ``{"op":"ping","op":"reload"}``
    would be read as a reload while anything that checks the first key (a log, a proxy,
    another parser) sees a ping: RFC 8259 §4 leaves duplicates undefined, so migd
    rejects them rather than pick one.

    Raises:
        ValueError: not JSON, or a duplicate key (:class:`DuplicateKeyError`).
        RecursionError: nested too deeply for the parser.
    """
    return json.loads(line, object_pairs_hook=_unique_keys)


def encode(obj: dict[str, Any]) -> bytes:
    """One message: compact JSON and a newline."""
    return json.dumps(obj, separators=(",", ":"), default=str).encode() + b"\n"


__all__ = ["API_VERSION", "MAX_NESTING", "DuplicateKeyError", "decode", "encode"]
