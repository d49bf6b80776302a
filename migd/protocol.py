"""The wire format's constants and framing, without pydantic.

Clients (``migctl``, the wrapper, the release hook) import this module instead of
:mod:`migd.api`, whose pydantic models cost ~0.2 s of start-up that a short-lived
``migctl status`` should not pay. :mod:`migd.api` re-exports everything here.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

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


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a finite number (JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON that Python reads as inf
        raise ValueError(f"{text} is not a finite number (it overflows a double)")
    return value


def decode(line: bytes | str) -> Any:
    """Parse one message, refusing an object that names a key twice, and numbers that
    are not finite.

    Python's json keeps the last of duplicate keys, so ``{"op":"ping","op":"reload"}``
    would be read as a reload while anything that checks the first key (a log, a proxy,
    another parser) sees a ping: RFC 8259 §4 leaves duplicates undefined, so migd
    rejects them rather than pick one. Python also reads the bare ``NaN``/``Infinity``
    that RFC 8259 does not have, and ``1e999`` as infinity: stored and sent back, they
    made replies that strict parsers refuse, so they are refused here.

    Raises:
        ValueError: not JSON, a duplicate key (:class:`DuplicateKeyError`), or a number
            that is not finite.
        RecursionError: nested too deeply for the parser.
    """
    return json.loads(
        line,
        object_pairs_hook=_unique_keys,
        parse_constant=_no_constant,
        parse_float=_finite_float,
    )


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by ``None`` (JSON's null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(obj: Any) -> str:
    """Compact, strict JSON: a number that is not finite (a row stored before decode
    refused them, a computed inf) goes out as ``null``, never as bare ``NaN``."""
    try:
        return json.dumps(obj, separators=(",", ":"), default=str, allow_nan=False)
    except ValueError:
        return json.dumps(finite(obj), separators=(",", ":"), default=str, allow_nan=False)


def encode(obj: dict[str, Any]) -> bytes:
    """One message: compact, strict JSON and a newline."""
    return dumps(obj).encode() + b"\n"


__all__ = [
    "API_VERSION",
    "MAX_NESTING",
    "DuplicateKeyError",
    "decode",
    "dumps",
    "encode",
    "finite",
]
