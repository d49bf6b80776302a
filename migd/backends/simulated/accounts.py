"""A fake :class:`migd.ports.Accounts`: the users and groups a test declares, nothing of
the host's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class FakeAccounts:
    """``users``: uid -> login name; ``groups``: group name -> gid; ``members``: uid ->
    the supplementary gids it is in (its primary gid always counts)."""

    users: Mapping[int, str] = field(default_factory=lambda: {0: "root"})
    groups: Mapping[str, int] = field(default_factory=lambda: {"root": 0})
    members: Mapping[int, frozenset[int]] = field(default_factory=dict)
    forgotten: int = 0

    def user_name(self, uid: int) -> str | None:
        return self.users.get(uid)

    def group_ids(self, uid: int, gid: int) -> frozenset[int]:
        return frozenset({gid}) | self.members.get(uid, frozenset())

    def group_id(self, name: str) -> int | None:
        return self.groups.get(name)

    def user_id(self, name: str) -> int | None:
        return next((uid for uid, user in self.users.items() if user == name), None)

    def forget(self) -> None:
        self.forgotten += 1
