"""The access point's GPU memory ladder: every size a GPU serves, requests rounded up to it."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from migd.core import catalog
from migd.core.vram_ladder import catalog_ladder, ladder, round_up

CONFIG = Path(__file__).resolve().parents[2] / "condor_config" / "20-migd-access-point.config"
PROFILES = sorted(
    (name, p.memory_mib) for name, g in catalog.builtin_models().items() for p in g.profiles
)
MAX = 81920


def _shipped(knob: str) -> str:
    [value] = re.findall(rf"^{knob} = (.*)$", CONFIG.read_text(), flags=re.M)
    return value


def test_the_shipped_ladder_is_the_catalog_ascending() -> None:
    shipped = tuple(int(x) for x in _shipped("MIGD_VRAM_LADDER").split(","))
    assert shipped == catalog_ladder()
    assert list(shipped) == sorted(set(shipped))  # quantize takes the first size large enough
    assert {4864, 40448, 80384, 81152, 143104} <= set(shipped)  # A100-40/80, H100, H200


def test_sizes_on_and_off_the_ladder() -> None:
    sizes = catalog_ladder()
    assert round_up(4000, sizes, MAX) == 4864
    assert round_up(4864, sizes, MAX) == 4864
    assert round_up(4865, sizes, MAX) == 5949
    assert round_up(81500, sizes, MAX) == MAX  # the pool's largest partition caps it
    assert round_up(90000, sizes, MAX) == 90000  # too big: held as asked, not rounded
    assert ladder([32768]) == tuple(sorted({*sizes, 32768}))


@settings(max_examples=500, deadline=None)
@given(profile=st.sampled_from(PROFILES), data=st.data())
def test_rounding_up_never_takes_a_partition_away(
    profile: tuple[str, int], data: st.DataObject
) -> None:
    """Any request a partition could hold, rounded, still fits that partition."""
    _, memory = profile
    request = data.draw(st.integers(1, memory))
    max_mib = data.draw(st.sampled_from([memory, MAX, 143104, 186368]))
    if memory > max_mib:
        return
    rounded = round_up(request, catalog_ladder(), max_mib)
    assert request <= rounded <= memory
