"""Who may do what, decided from the peer's kernel credentials (SO_PEERCRED).

Nothing a message claims about its sender counts: the uid, gid and pid come
from the socket. Users and groups in the config may be names or numeric IDs;
``"*"`` means any local user.

* ``lease``: ``api.lease_users`` / ``api.lease_groups`` (HTCondor runs the job
  wrapper as the job's user, so sites list their batch users' group here, or
  ``"*"``), plus admins.
* ``release``/``heartbeat``/``usage``/``report``/``get_lease``: the lease's
  owner (same uid), or an admin.
* ``release_job`` (the JOB_EXIT hook): admins and ``api.hook_users`` release every
  lease of the job; anyone else only the job's leases it owns (HTCondor runs the
  hook as the job's user, docs/htcondor-notes.md (f)).
* ``status``/``leases``/``explain``/``history``: anyone when
  ``api.status_public``, else lease users and admins.
* ``drain``/``resume``/``reset``/``reload``: admins (``root`` always is one).
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass
from functools import lru_cache

from migd.daemon.config import ApiSection
from migd.errors import NotAuthorized


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int

    @classmethod
    def from_socket(cls, sock: socket.socket) -> Peer:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return cls(pid, uid, gid)

    @property
    def user(self) -> str:
        return _user_name(self.uid)


def forget_accounts() -> None:
    """Drop the cached user names and group memberships (on SIGHUP: an admin who added
    a user to a group, then reloaded, expects it to count)."""
    _user_name.cache_clear()
    _group_ids.cache_clear()


@lru_cache(maxsize=1024)
def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@lru_cache(maxsize=1024)
def _group_ids(uid: int, gid: int) -> frozenset[int]:
    try:
        name = pwd.getpwuid(uid).pw_name
        return frozenset(os.getgrouplist(name, gid))
    except (KeyError, OSError):
        return frozenset({gid})


def _gid(name: str) -> int | None:
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _matches(peer: Peer, users: list[str], groups: list[str]) -> bool:
    if "*" in users or "*" in groups:
        return True
    if str(peer.uid) in users or peer.user in users:
        return True
    peer_groups = _group_ids(peer.uid, peer.gid)
    return any((g := _gid(name)) is not None and g in peer_groups for name in groups)


class Authorizer:
    def __init__(self, api: ApiSection) -> None:
        self.api = api

    def is_admin(self, peer: Peer) -> bool:
        return peer.uid == 0 or _matches(peer, self.api.admin_users, self.api.admin_groups)

    def may_lease(self, peer: Peer) -> bool:
        return self.is_admin(peer) or _matches(peer, self.api.lease_users, self.api.lease_groups)

    def may_release_any(self, peer: Peer) -> bool:
        """May release any job's leases by job id (``release_job``)."""
        return self.is_admin(peer) or _matches(peer, self.api.hook_users, [])

    def require_lease(self, peer: Peer) -> None:
        if not self.may_lease(peer):
            raise NotAuthorized(
                f"user {peer.user} (uid {peer.uid}) may not request GPU leases",
                hint="add the user or its group to api.lease_users/lease_groups in migd.toml",
                uid=peer.uid,
            )

    def require_owner(self, peer: Peer, owner_uid: int, what: str) -> None:
        if peer.uid != owner_uid and not self.is_admin(peer):
            raise NotAuthorized(
                f"user {peer.user} (uid {peer.uid}) may not {what} a lease of uid {owner_uid}",
                hint="only the lease's owner or an admin may do that",
                uid=peer.uid,
            )

    def require_read(self, peer: Peer) -> None:
        if not (self.api.status_public or self.may_lease(peer)):
            raise NotAuthorized(
                f"user {peer.user} may not read migd's status",
                hint="set api.status_public = true, or ask an admin",
            )

    def require_admin(self, peer: Peer, what: str) -> None:
        if not self.is_admin(peer):
            raise NotAuthorized(
                f"user {peer.user} (uid {peer.uid}) may not {what}",
                hint="admin operations need root or a user in api.admin_users/admin_groups",
                uid=peer.uid,
            )
