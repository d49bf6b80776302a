"""The HTCondor-like matcher's ranking: what each node advertises, and which nodes a job
is offered, in which order.

A node advertises the most memory one new job could get on it now (its machine ad:
the largest partition its GPUs' mode drivers could place, ``largest_placeable``) and,
for MPS servers inside MIG instances, their unpinned MiB to the user each serves. A
job is offered the nodes whose ad holds it, best fit first (``first-fit``: by index);
on static layouts, the smallest idle instance that holds it, as HTCondor matching a
job to a statically partitioned slot would. The matcher asks nodes; it never changes
them (the event loop, :mod:`migd.policysim.engine`, submits).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

from migd.core.geometry import Profile
from migd.core.gpus import InstanceStatus
from migd.core.leases import Lease, LeaseRequest
from migd.errors import InvalidRequest, RequestTooLarge
from migd.policysim.nodes import PoolNode
from migd.policysim.policies import PolicySpec
from migd.policysim.records import Attempt


def lease_for(
    attempt: Attempt, now_s: float, wait_s: float | None, profile: str | None = None
) -> Lease:
    """The lease a submission of ``attempt`` asks the node's scheduler for."""
    request = LeaseRequest(
        job_id=attempt.lease_id,
        memory_mib=attempt.memory_mib,
        min_compute=attempt.min_compute,
        profile=profile,
        wait_s=wait_s,
    )
    return Lease(attempt.lease_id, request, attempt.job.uid, 1, now_s)


def holds(profile: Profile, attempt: Attempt) -> bool:
    """Whether an instance of ``profile`` holds the job's memory and compute."""
    return (
        profile.memory_mib >= attempt.memory_mib and profile.compute_slices >= attempt.min_compute
    )


class Matcher:
    """The nodes' advertisements as the matcher sees them, and the ranking of nodes.

    An ad is computed again only for a node that changed (:meth:`invalidate`); nodes sit
    in buckets by advertised MiB, so a pool of a thousand nodes costs one look per
    bucket, not one per node and job.
    """

    def __init__(self, nodes: Sequence[PoolNode], policy: PolicySpec) -> None:
        self.nodes = nodes
        self.policy = policy
        self._advert_cache: dict[Hashable, tuple[str, int] | None] = {}
        self._by_capacity: dict[int, set[int]] = {}  # advertised MiB -> node indices
        self._stale: set[int] = set(range(len(nodes)))  # ads to compute again
        self._rooms: dict[int | None, dict[int, int]] = {}  # uid -> node -> MPS host MiB
        # (node, GPU) -> (its books' version, available, what it could place then): a
        # node's ad is made again whenever anything on it changed, usually one GPU of
        # eight, and the scheduler's books versions say which (NodeScheduler.books_version)
        self._gpu_ads: dict[tuple[int, int], tuple[int, bool, tuple[str, int] | None]] = {}

    def invalidate(self, node: PoolNode) -> None:
        """The node changed: its advertised capacity is computed again when asked."""
        node.ad_due = None  # a fresh ad carries every change so far
        if node.capacity is not None:
            self._by_capacity[node.capacity].discard(node.index)
            node.capacity = None
        for uid in node.rooms:
            self._rooms[uid].pop(node.index, None)
        node.rooms = {}
        self._stale.add(node.index)

    def ever_fits(self, node: PoolNode, attempt: Attempt) -> bool:
        """What the node's machine ad says about the job, ignoring what is in use now.

        The node's own check (:meth:`NodeScheduler.check_ever_fits`, as ``submit``
        does it); a static node advertises only its instances, as HTCondor slots.
        """
        key = (attempt.memory_mib, attempt.min_compute)
        fits = node.ever_fits.get(key)
        if fits is None:
            try:
                node.scheduler.check_ever_fits(lease_for(attempt, 0.0, None))
                fits = True
            except (RequestTooLarge, InvalidRequest):
                fits = False
            node.ever_fits[key] = fits
        if not fits:
            return False
        if self.policy.static_layout is None:
            return True
        gpus = node.scheduler.gpus.values()
        return any(holds(i.profile, attempt) for g in gpus for i in g.instances)

    def static_slots(self, attempt: Attempt) -> list[tuple[PoolNode, str]]:
        """Idle instances that hold the job, smallest first (memory, compute, node, GPU):
        each node with the profile to ask it for."""
        idle: list[tuple[int, int, int, int, Profile]] = []
        for node in self.nodes:
            for gpu in node.scheduler.gpus.values():
                for inst in gpu.instances:
                    if not inst.busy and holds(inst.profile, attempt):
                        p = inst.profile
                        idle.append((p.memory_mib, p.compute_slices, node.index, gpu.index, p))
        ranked = sorted(idle, key=lambda x: x[:4])
        return [(self.nodes[node_index], prof.name) for *_, node_index, _gpu, prof in ranked]

    def fitting_nodes(self, memory_mib: int, uid: int) -> Iterator[PoolNode]:
        """Nodes that advertise at least ``memory_mib`` to user ``uid``, in the policy's
        node order.

        The best-fit order is produced lazily, as the matcher usually takes the first
        node. MPS servers inside MIG instances serve one user each (unless multi-user):
        their unpinned MiB is advertised to that user only.
        """
        for index in self._stale:
            node = self.nodes[index]
            self._by_capacity.setdefault(self._advertised_mib(node), set()).add(index)
            node.rooms = self._host_rooms(node)
            for who, room in node.rooms.items():
                self._rooms.setdefault(who, {})[index] = room
        self._stale.clear()
        # nodes whose MPS hosts offer this user more than their ad (or than nothing)
        over: dict[int, int] = {}
        for who in (uid, None):
            for i, room in self._rooms.get(who, {}).items():
                if room < memory_mib:
                    continue
                known = over.get(i)
                if known is None:
                    ad = self.nodes[i].capacity
                    known = ad if ad is not None and ad >= memory_mib else -1
                if room > known:
                    over[i] = room
        caps = sorted(c for c in self._by_capacity if c >= memory_mib)
        if self.policy.node_order != "best-fit":
            ids = {i for c in caps for i in self._by_capacity[c]} | over.keys()
            return iter([self.nodes[i] for i in sorted(ids)])
        return self._best_fit(caps, sorted((c, i) for i, c in over.items()), over)

    def _best_fit(
        self, caps: list[int], rooms: list[tuple[int, int]], over: dict[int, int]
    ) -> Iterator[PoolNode]:
        """Nodes by (advertised MiB, index): each bucket of ``caps`` in index order,
        merged with the nodes that ``rooms`` advertise more for. A bucket is read when
        reached: only nodes already offered the job change meanwhile."""
        k = 0
        for c in caps:
            for i in sorted(self._by_capacity[c]):
                if i in over:
                    continue
                while k < len(rooms) and rooms[k] < (c, i):
                    yield self.nodes[rooms[k][1]]
                    k += 1
                yield self.nodes[i]
        for _, i in rooms[k:]:
            yield self.nodes[i]

    @staticmethod
    def _host_rooms(node: PoolNode) -> dict[int | None, int]:
        """Unpinned MiB of the node's MPS hosts by the user they serve (None: anyone)."""
        rooms: dict[int | None, int] = {}
        for gpu in node.scheduler.gpus.values():
            for inst in gpu.instances:
                pool = inst.mps_pool
                if pool is None or inst.status is not InstanceStatus.READY:
                    continue
                if pool.clients >= pool.max_clients:
                    continue
                users = {share.uid for share in pool.shares}
                who = (
                    users.pop()
                    if len(users) == 1 and not node.scheduler.policy.mps_multi_user
                    else None
                )
                rooms[who] = max(rooms.get(who, 0), pool.free_mib)
        return rooms

    def _advertised_mib(self, node: PoolNode) -> int:
        """The most memory one new job could get on the node now (its machine ad): the
        largest partition any of its GPUs' mode drivers could place.

        A driver's answer depends only on what its ``layout_key`` names (a MIG GPU's
        layout and which instances are busy), so it is memoised by that: a pool of
        thousands of GPUs with a few hundred distinct layouts plans each once.
        """
        if node.capacity is not None:
            return node.capacity
        sched = node.scheduler
        best = 0
        for gpu in sched.gpus.values():
            available = gpu.available
            if not available:
                continue
            version = sched.books_version(gpu.index)
            known = self._gpu_ads.get((node.index, gpu.index))
            if known is not None and known[0] == version and known[1] == available:
                found = known[2]
            else:
                ops = sched.mode_ops(gpu)
                key = ops.layout_key(gpu)
                if key is None:
                    found = ops.largest_placeable(gpu)
                elif key in self._advert_cache:
                    found = self._advert_cache[key]
                else:
                    found = self._advert_cache[key] = ops.largest_placeable(gpu)
                self._gpu_ads[(node.index, gpu.index)] = (version, available, found)
            if found is not None:
                best = max(best, found[1])
        node.capacity = best
        return best
