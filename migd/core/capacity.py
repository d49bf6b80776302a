"""How much GPU memory a node can still hand out, as HTCondor should be told.

``MigdFreeMB`` used to be "memory not held by busy instances", which counts memory
no profile can use: 7 busy 1g.5gb instances on an A100-40GB leave 6400 MiB "free"
and no room for anything. The placeable memory of a MIG GPU is instead the most
memory the instances that can still be created could hold together: the best
completion of the busy layout to a full state of the GPU's state machine (idle
instances count as free: migd reuses or replaces them). On an empty GPU that is
the full profile's memory, the GPU's share of the startd's ``TotalVRAM``.
"""

from __future__ import annotations

from collections.abc import Iterable

from migd.core.geometry import Profile
from migd.core.states import StateKey, StateSpace


def placeable_mib(space: StateSpace, busy: Iterable[tuple[Profile, int]]) -> int:
    """Most memory (MiB) new instances can hold next to the ``busy`` ones (profile, start).

    Raises:
        MigdError: ``busy`` is not a state of ``space`` (the caller reports the layout).
    """
    key: StateKey = space.key_of(busy)
    best = 0
    for full in space.full_states:
        if full & key != key:
            continue
        extra = full & ~key
        mib = sum(a.profile.memory_mib for a in space.atoms if extra >> a.index & 1)
        best = max(best, mib)
    return best
