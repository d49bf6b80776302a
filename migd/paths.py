"""Safe places for what migd creates: the socket, the runtime and the state directories.

migd runs as root and creates directories, sockets and files under its runtime
directory (``/run/migd``: the socket, ``mps/`` pipe and log directories) and its state
directory (``/var/lib/migd``). A path there that another user controls would let that
user redirect migd's ``mkdir``/``chmod``/``chown`` onto any file of the system (a
symlink ``/run/migd/mps -> /root`` made ``/root`` 0755). So:

* every directory from ``/`` down to the runtime or state directory must be a real
  directory (no symlinked component), owned by root or by migd's user, and writable by
  group or others only if it is root's and sticky (``/tmp``); the directory itself not
  at all (:func:`check_directory_chain`, the socket path's rules since 0.1);
* below it, migd walks with directory descriptors and ``O_NOFOLLOW`` (never a path
  string that the kernel resolves again), so a component swapped for a symlink between
  the check and the use is refused, not followed (:func:`ensure_dir`).

Every refusal is a :class:`~migd.errors.ConfigError` naming the setting and the path.

One daemon per state: :class:`InstanceLock` holds an exclusive ``flock`` on
``migd.lock`` in the state and the runtime directory for the life of the process, taken
before the state db is opened or anything is created in either (two daemons on one
database released each other's leases).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Sequence
from pathlib import Path, PurePath

from migd.errors import AlreadyRunning, ConfigError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _ours() -> tuple[int, ...]:
    return (0, os.geteuid())


def check_directory_chain(path: Path, where: str, *, purpose: str = "its files") -> None:
    """Refuse a directory another user could tamper with (see the module docstring).

    Raises:
        ConfigError: a component is a symlink, not a directory, owned by another user,
            or writable by others (an ancestor: unless root's and sticky).
    """
    path = Path(os.path.normpath(path.absolute()))  # not resolve(): symlinks must be seen
    for directory in (path, *path.parents):
        try:
            st = directory.lstat()
        except OSError as exc:
            raise ConfigError(f"cannot check {directory}: {exc.strerror}", where=where) from exc
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(
                f"{directory} is a symlink; migd never follows one to {purpose}",
                where=where,
                hint=f"give the real path ({directory} -> {os.path.realpath(directory)})",
            )
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{directory} is not a directory", where=where)
        if st.st_uid not in _ours():
            raise ConfigError(
                f"{directory} belongs to uid {st.st_uid}, who could redirect {purpose}",
                where=where,
                hint="use a directory owned by root, such as /run/migd or /var/lib/migd",
            )
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        sticky_root = st.st_mode & stat.S_ISVTX and st.st_uid == 0
        if writable and (directory == path or not sticky_root):
            who = "world" if st.st_mode & stat.S_IWOTH else "group"
            raise ConfigError(
                f"{directory} is {who}-writable; another user could replace {purpose}",
                where=where,
                hint="use a private directory (the systemd unit creates /run/migd and "
                "/var/lib/migd)",
            )


def ensure_dir(
    base: Path,
    relative: PurePath | str,
    mode: int,
    *,
    owner: tuple[int, int] | None = None,
    where: str = "daemon.runtime_dir",
) -> Path:
    """Create (or check) ``base/relative`` with ``mode``, never following a symlink.

    ``base`` must pass :func:`check_directory_chain` (it is created 0755 if missing,
    from a checked parent). Each component below is made with ``mkdir(dir_fd=...)`` and
    opened with ``O_NOFOLLOW``; intermediate ones must be migd's and not writable by
    others; the last gets ``mode`` (and ``owner``, as root) through its descriptor.

    Raises:
        ConfigError: a symlink, a non-directory or a foreign-owned directory on the way.
    """
    base = Path(os.path.normpath(base.absolute()))
    if not base.exists() and not base.is_symlink():
        check_directory_chain(base.parent, where, purpose=f"{base}")
        with contextlib.suppress(FileExistsError):
            base.mkdir(0o755)
    check_directory_chain(base, where, purpose=f"what migd creates under {base}")
    parts = [p for p in PurePath(relative).parts if p not in ("", ".")]
    if any(p == ".." or "/" in p for p in parts):
        raise ConfigError(f"{relative!s} leaves {base}", where=where)
    fd = _open_dir(base, None, base, where)
    try:
        current = base
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            current = current / name
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755 if not last else mode & 0o777, dir_fd=fd)
            child = _open_dir(current, fd, name, where)
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            allowed = _ours() + ((owner[0],) if last and owner is not None else ())
            if st.st_uid not in allowed:
                raise ConfigError(
                    f"{current} belongs to uid {st.st_uid}; migd does not use it",
                    where=where,
                    hint=f"remove {current}; migd creates it again",
                )
            if not last and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ConfigError(
                    f"{current} is writable by others; migd does not create files under it",
                    where=where,
                    hint=f"remove {current}; migd creates it again",
                )
        if parts:
            st = os.fstat(fd)
            # Only when something changes: a read-only state disk must still be usable
            # far enough for the store to say what is wrong with it.
            if stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)
            if owner is not None and os.geteuid() == 0 and (st.st_uid, st.st_gid) != owner:
                os.fchown(fd, owner[0], owner[1])
        return current
    finally:
        os.close(fd)


def _open_dir(path: Path, dir_fd: int | None, name: Path | str, where: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConfigError(
                f"{path} is a symlink or not a directory; migd never follows one there",
                where=where,
                hint=f"remove {path}; migd creates it again",
            ) from exc
        raise ConfigError(f"cannot open {path}: {exc.strerror}", where=where) from exc


#: The lock file in the state and the runtime directory; it holds the owner's pid.
LOCK_NAME = "migd.lock"


class InstanceLock:
    """Exclusive locks on ``<dir>/migd.lock`` of each directory, held until :meth:`release`
    (or the process ends: the kernel drops a ``flock`` with its last descriptor, so a
    ``kill -9`` leaves no stale lock behind; the file itself is left in place)."""

    def __init__(self, fds: Sequence[int]) -> None:
        self._fds = list(fds)

    @classmethod
    def acquire(cls, directories: Sequence[tuple[Path, str]]) -> InstanceLock:
        """Lock each ``(directory, setting)`` in turn (it must exist and pass
        :func:`check_directory_chain`); all or none.

        Raises:
            AlreadyRunning: another process holds one of the locks (its pid is named
                when its lock file says it).
            ConfigError: a lock file that is a symlink or cannot be opened.
        """
        fds: list[int] = []
        try:
            seen: set[Path] = set()
            for given, where in directories:
                directory = Path(os.path.normpath(given.absolute()))
                if directory not in seen:  # one file, one lock: a second flock would block
                    seen.add(directory)
                    fds.append(_lock_in(directory, where))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(fds)

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _lock_in(directory: Path, where: str) -> int:
    """Open (create 0644) and ``flock`` ``directory/migd.lock``, never through a symlink;
    write our pid into it. A read-only directory with the file already there is locked
    read-only (``flock`` needs no write access)."""
    dir_fd = _open_dir(directory, None, directory, where)
    path = directory / LOCK_NAME
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(LOCK_NAME, flags | os.O_RDWR | os.O_CREAT, 0o644, dir_fd=dir_fd)
            writable = True
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.ENOSPC, errno.EDQUOT):
                raise
            fd = os.open(LOCK_NAME, flags | os.O_RDONLY, dir_fd=dir_fd)
            writable = False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{path} is a symlink; migd never follows one",
                where=where,
                hint=f"remove {path}; migd creates it again",
            ) from exc
        raise ConfigError(f"cannot open the lock file {path}: {exc.strerror}", where=where) from exc
    finally:
        os.close(dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise AlreadyRunning(
            f"another migd{f' (pid {holder})' if holder else ''} is running on {directory} "
            f"({where}); refusing to start, nothing was changed",
            holder_pid=holder,
            lock_file=str(path),
        ) from None
    if writable:
        # Who holds it, for the next one's message; a full disk must not stop the start.
        # Written over the old pid, then cut: on a full disk the old file's blocks take it.
        pid = f"{os.getpid()}\n".encode()
        with contextlib.suppress(OSError):
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
    return fd


def _holder(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 32, 0).decode("ascii").strip()
        return int(text) if text else None
    return None
