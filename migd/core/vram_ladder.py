"""The GPU memory sizes a pool's GPUs can serve, and a request rounded up to one (pure).

Free-form ``RequestVRAM`` values make near-unique autoclusters, and the negotiator's cycle
grows with autoclusters times idle slots. The access point's transform
(``condor_config/20-migd-access-point.config``, ``MIGD_VRAM_LADDER``) rounds each request up
to the ladder: the memory of every MIG profile of every GPU model migd knows, plus the whole
memory of the pool's GPUs without MIG. Because every size a GPU can hand out is on the
ladder, rounding up never takes a GPU away from a job: if a partition of ``p`` MiB could hold
``r`` MiB (``r <= p``), it holds the rounded request too (:func:`round_up` ``(r) <= p``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def catalog_ladder() -> tuple[int, ...]:
    """Every MIG profile's memory (MiB) in migd's catalog, ascending, without repeats."""
    from migd.core import catalog

    sizes = {p.memory_mib for g in catalog.builtin_models().values() for p in g.profiles}
    return tuple(sorted(sizes))


def ladder(extra_mib: Iterable[int] = ()) -> tuple[int, ...]:
    """The catalog's ladder plus ``extra_mib`` (the memory of GPUs shared without MIG)."""
    return tuple(sorted(set(catalog_ladder()) | {int(m) for m in extra_mib if int(m) > 0}))


def round_up(request_mib: int, sizes: Sequence[int], max_mib: int) -> int:
    """The smallest ladder size >= ``request_mib``, at most ``max_mib`` (the pool's largest
    partition, ``MIGD_MAX_VRAM``: itself a size some GPU serves); a request above
    ``max_mib`` stays as it is (it is held, not rounded).

    The transform's ``min({quantize(RequestVRAM, {ladder}), MIGD_MAX_VRAM})``."""
    if request_mib > max_mib:
        return request_mib
    return min(next((s for s in sizes if s >= request_mib), max_mib), max_mib)
