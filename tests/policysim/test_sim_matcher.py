"""The matcher's ranking: the lazy best-fit order is the eager sort it replaced."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from migd.core.catalog import geometry
from migd.core.gpus import GpuMode
from migd.core.states import state_space
from migd.policysim.driver import NvmlDriver
from migd.policysim.matcher import Matcher
from migd.policysim.nodes import build_node
from migd.policysim.policies import named_policy

A100 = geometry("A100-40GB")
SPACE = state_space(A100, "classic")
CAPS = (0, 4864, 9984, 20096, 40192)


def eager_order(
    caps: dict[int, int], rooms: dict[int | None, dict[int, int]], memory: int, uid: int
) -> list[int]:
    """The order as the matcher computed it before (every fitting node, then one sort)."""
    cap = {i: c for i, c in caps.items() if c >= memory}
    for who in (uid, None):
        for i, room in rooms.get(who, {}).items():
            if room >= memory and room > cap.get(i, -1):
                cap[i] = room
    return sorted(cap, key=lambda i: (cap[i], i))


@settings(max_examples=150, deadline=None)
@given(
    caps=st.lists(st.sampled_from(CAPS), min_size=1, max_size=12),
    rooms=st.dictionaries(
        st.sampled_from([None, 1, 2]),
        st.dictionaries(st.integers(0, 11), st.integers(0, 40192), max_size=6),
        max_size=3,
    ),
    memory=st.sampled_from([1, 4000, 4864, 9000, 20000, 30000, 40192]),
    uid=st.sampled_from([1, 2]),
)
def test_best_fit_order_is_the_eager_sort(
    caps: list[int], rooms: dict[int | None, dict[int, int]], memory: int, uid: int
) -> None:
    policy = named_policy("migd")
    driver = NvmlDriver(None, [])  # type: ignore[arg-type]  # no work is run
    nodes = [
        build_node(i, 1, geo=A100, space=SPACE, policy=policy, driver=driver)
        for i in range(len(caps))
    ]
    assert nodes[0].scheduler.gpus[0].mode is GpuMode.MIG
    matcher = Matcher(nodes, policy)
    # the ads as a pool would have them: buckets by advertised MiB, hosts' room per user
    matcher._stale.clear()
    for node, c in zip(nodes, caps, strict=True):
        node.capacity = c
        matcher._by_capacity.setdefault(c, set()).add(node.index)
    rooms = {who: {i: r for i, r in by.items() if i < len(nodes)} for who, by in rooms.items()}
    for who, by in rooms.items():
        for i, room in by.items():
            nodes[i].rooms[who] = room
            matcher._rooms.setdefault(who, {})[i] = room
    got = [n.index for n in matcher.fitting_nodes(memory, uid)]
    assert got == eager_order(dict(enumerate(caps)), rooms, memory, uid)
