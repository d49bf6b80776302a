"""Memory sizes as people write them, to MiB (the unit migd uses everywhere)."""

from __future__ import annotations

import re

from migd.errors import InvalidRequest

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

# Binary and decimal suffixes. HTCondor and nvidia-smi use binary units with
# decimal-looking names ("G" in request_memory is GiB), so G/GB/GiB all mean GiB
# here too: a job that asks for "10G" must get at least 10 GiB.
_FACTORS_MIB: dict[str, float] = {
    "": 1.0,
    "m": 1.0,
    "mb": 1.0,
    "mib": 1.0,
    "g": 1024.0,
    "gb": 1024.0,
    "gib": 1024.0,
    "t": 1024.0 * 1024.0,
    "tb": 1024.0 * 1024.0,
    "tib": 1024.0 * 1024.0,
    "k": 1.0 / 1024.0,
    "kb": 1.0 / 1024.0,
    "kib": 1.0 / 1024.0,
}


def parse_mib(text: str | int | float) -> int:
    """Parse ``"10G"``, ``"10240"``, ``"1.5GiB"``, ``"512M"`` to whole MiB (rounded up).

    A bare number means MiB, as HTCondor's ``request_VRAM`` does.

    Raises:
        InvalidRequest: the text is not a non-negative size with a known suffix.
    """
    if isinstance(text, bool):
        raise InvalidRequest(f"not a memory size: {text!r}")
    if isinstance(text, int | float):
        if text < 0:
            raise InvalidRequest(f"memory size must not be negative: {text}")
        return int(-(-text // 1))
    match = _SIZE_RE.match(text)
    if not match:
        raise InvalidRequest(
            f"not a memory size: {text!r}", hint="write e.g. 10G, 512M or 20480 (MiB)"
        )
    number, suffix = match.groups()
    factor = _FACTORS_MIB.get(suffix.lower())
    if factor is None:
        raise InvalidRequest(
            f"unknown unit {suffix!r} in {text!r}", hint="use M/MiB, G/GiB or T/TiB"
        )
    mib = float(number) * factor
    return int(-(-mib // 1))


def format_mib(mib: int) -> str:
    """``20480`` -> ``"20.0 GiB"``, ``512`` -> ``"512 MiB"``."""
    if mib >= 1024:
        return f"{mib / 1024:.1f} GiB"
    return f"{mib} MiB"
