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

import socket
import struct
from dataclasses import dataclass

from migd.daemon.config import ApiSection
from migd.errors import NotAuthorized
from migd.ports import Accounts


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


class Authorizer:
    """The access rules of an ``[api]`` section over the host's users and groups (the
    :class:`~migd.ports.Accounts` port, passed in at start-up)."""

    def __init__(self, api: ApiSection, accounts: Accounts) -> None:
        self.api = api
        self.accounts = accounts

    def user_name(self, peer: Peer) -> str:
        """The peer's login name, or its uid as text when the host has no such user."""
        return self.accounts.user_name(peer.uid) or str(peer.uid)

    def _gid(self, name: str) -> int | None:
        return int(name) if name.isdigit() else self.accounts.group_id(name)

    def _matches(self, peer: Peer, users: list[str], groups: list[str]) -> bool:
        if "*" in users or "*" in groups:
            return True
        if str(peer.uid) in users or self.user_name(peer) in users:
            return True
        peer_groups = self.accounts.group_ids(peer.uid, peer.gid)
        return any((g := self._gid(name)) is not None and g in peer_groups for name in groups)

    def is_admin(self, peer: Peer) -> bool:
        return peer.uid == 0 or self._matches(peer, self.api.admin_users, self.api.admin_groups)

    def may_lease(self, peer: Peer) -> bool:
        return self.is_admin(peer) or self._matches(
            peer, self.api.lease_users, self.api.lease_groups
        )

    def may_release_any(self, peer: Peer) -> bool:
        """May release any job's leases by job id (``release_job``)."""
        return self.is_admin(peer) or self._matches(peer, self.api.hook_users, [])

    def require_lease(self, peer: Peer) -> None:
        if not self.may_lease(peer):
            raise NotAuthorized(
                f"user {self.user_name(peer)} (uid {peer.uid}) may not request GPU leases",
                hint="add the user or its group to api.lease_users/lease_groups in migd.toml",
                uid=peer.uid,
            )

    def require_owner(self, peer: Peer, owner_uid: int, what: str) -> None:
        if peer.uid != owner_uid and not self.is_admin(peer):
            raise NotAuthorized(
                f"user {self.user_name(peer)} (uid {peer.uid}) may not {what} a lease of "
                f"uid {owner_uid}",
                hint="only the lease's owner or an admin may do that",
                uid=peer.uid,
            )

    def require_read(self, peer: Peer) -> None:
        if not (self.api.status_public or self.may_lease(peer)):
            raise NotAuthorized(
                f"user {self.user_name(peer)} may not read migd's status",
                hint="set api.status_public = true, or ask an admin",
            )

    def require_admin(self, peer: Peer, what: str) -> None:
        if not self.is_admin(peer):
            raise NotAuthorized(
                f"user {self.user_name(peer)} (uid {peer.uid}) may not {what}",
                hint="admin operations need root or a user in api.admin_users/admin_groups",
                uid=peer.uid,
            )
