"""The host's users and groups from the passwd and group databases (NSS), cached.

Each connection's access check asks for the peer's name and groups; an NSS lookup can
reach LDAP or SSSD, so answers are cached until :meth:`SystemAccounts.forget` (the
daemon calls it on SIGHUP).
"""

from __future__ import annotations

import grp
import os
import pwd
from functools import lru_cache


class SystemAccounts:
    """:class:`migd.ports.Accounts` for this host."""

    def __init__(self) -> None:
        # Per instance (not module-level) caches: two daemons in one process, or a
        # test, never see each other's answers.
        self._user_name = lru_cache(maxsize=1024)(self._lookup_user_name)
        self._group_ids = lru_cache(maxsize=1024)(self._lookup_group_ids)

    def user_name(self, uid: int) -> str | None:
        return self._user_name(uid)

    def group_ids(self, uid: int, gid: int) -> frozenset[int]:
        return self._group_ids(uid, gid)

    def group_id(self, name: str) -> int | None:
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            return None

    def user_id(self, name: str) -> int | None:
        try:
            return pwd.getpwnam(name).pw_uid
        except KeyError:
            return None

    def forget(self) -> None:
        self._user_name.cache_clear()
        self._group_ids.cache_clear()

    def cached(self) -> int:
        """How many answers are cached (for tests of :meth:`forget`)."""
        return self._user_name.cache_info().currsize + self._group_ids.cache_info().currsize

    @staticmethod
    def _lookup_user_name(uid: int) -> str | None:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return None

    @staticmethod
    def _lookup_group_ids(uid: int, gid: int) -> frozenset[int]:
        try:
            name = pwd.getpwuid(uid).pw_name
            return frozenset(os.getgrouplist(name, gid))
        except (KeyError, OSError):
            return frozenset({gid})
