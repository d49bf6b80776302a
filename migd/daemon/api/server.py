"""The API server: the unix socket, admission, and the op -> handler table.

A connection carries one request line and gets one reply line (see docs/api.md). The
server checks the socket's location and access, limits connections per user, decodes
the request, checks the authorisation its op declares (:class:`Access`) and calls the
op's handler from the table (:meth:`ApiServer.register`). Handlers live with what they
drive (:mod:`migd.daemon.api.ops`, :mod:`migd.daemon.api.sim_ops`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog

from migd.api import LeaseRef, ReportRequest, Request, decode_request, error_reply, ok_reply
from migd.core.leases import Lease
from migd.daemon.api.auth import Peer
from migd.daemon.config import ApiSection
from migd.daemon.context import DaemonContext
from migd.errors import (
    ConfigError,
    DaemonUnavailable,
    InvalidRequest,
    LeaseNotFound,
    MigdError,
    NotAuthorized,
    ProtocolError,
)
from migd.paths import check_directory_chain
from migd.ports import Accounts

log = structlog.get_logger("migd")

# How long a refused connection may take to send its request before it is closed: long
# enough for a client that writes right after connecting, short enough that refused
# connections cannot pile up.
_REFUSAL_GRACE_S = 1.0


class UnsentBytes:
    """Bytes of replies written to clients that have not taken them yet, per uid and in
    total (api.max_unsent_bytes_per_uid, api.max_unsent_bytes).

    A reply is counted from the moment it is written until its connection is closed or
    dropped: whatever the kernel has not taken sits in the transport's buffer, in migd's
    memory. A request is admitted only while its uid's budget and the total still have
    room for one more full page (api.max_reply_bytes), so a refusal costs no reply built
    for nothing. Root is never refused; its replies count in the total."""

    def __init__(self) -> None:
        self.total = 0
        self.per_uid: dict[int, int] = {}

    def refusal(self, uid: int, api: ApiSection, need: int) -> MigdError | None:
        """Why a request of ``uid`` whose reply may be ``need`` bytes is refused now, or
        None."""
        if uid == 0:
            return None
        held = self.per_uid.get(uid, 0)
        hint = "read your replies, or close connections you do not read; retry in a few seconds"
        if held + need > api.max_unsent_bytes_per_uid:
            return DaemonUnavailable(
                f"uid {uid} has left {held} bytes of replies unread "
                f"(api.max_unsent_bytes_per_uid = {api.max_unsent_bytes_per_uid})",
                hint=hint,
            )
        if self.total + need > api.max_unsent_bytes:
            return DaemonUnavailable(
                f"migd holds {self.total} bytes of replies its clients have not read "
                f"(api.max_unsent_bytes = {api.max_unsent_bytes})",
                hint=hint,
            )
        return None

    def take(self, uid: int, size: int) -> None:
        self.total += size
        self.per_uid[uid] = self.per_uid.get(uid, 0) + size

    def give(self, uid: int, size: int) -> None:
        self.total -= size
        left = self.per_uid[uid] - size
        if left:
            self.per_uid[uid] = left
        else:
            del self.per_uid[uid]


class Access(Enum):
    """Who may call an op; checked by the server before the handler runs."""

    ANYONE = "anyone"  # ping; handlers that decide per request (release_job)
    READ = "read"  # api.status_public, or a lease user or admin
    LEASE = "lease"  # api.lease_users / lease_groups
    ADMIN = "admin"  # api.admin_users / admin_groups
    OWNER = "owner"  # the lease named by the request's lease_id is the caller's (or admin)


R = TypeVar("R")


@dataclass(frozen=True)
class Call(Generic[R]):
    """One decoded request as a handler gets it (``R``: the op's model in migd.api)."""

    request: R
    peer: Peer
    reader: asyncio.StreamReader
    #: For ``Access.OWNER`` ops: the request's lease, ownership checked.
    lease: Lease | None = None

    @property
    def owned(self) -> Lease:
        assert self.lease is not None
        return self.lease


Handler = Callable[[Call[Any]], Awaitable[Any]]


@dataclass(frozen=True)
class OpSpec:
    handler: Handler
    access: Access
    #: What the caller is refused, for the error message (``{op}`` is replaced).
    verb: str = ""


class ApiServer:
    """See the module docstring.

    Args:
        ctx: the daemon's shared state (its ``auth`` is replaced on reload).
        lease_for: finds a lease by id (for ``Access.OWNER`` ops).
        stopping: set once migd stops; new requests are then refused.
    """

    def __init__(
        self, ctx: DaemonContext, lease_for: Callable[[str], Lease], stopping: asyncio.Event
    ) -> None:
        self.ctx = ctx
        self.lease_for = lease_for
        self.stopping = stopping
        self.ops: dict[str, OpSpec] = {}
        #: Ops with no handler here and the error that says why (e.g. simulator-only ops).
        self.missing: dict[str, Callable[[str], MigdError]] = {}
        self._server: asyncio.AbstractServer | None = None
        self._clients = 0  # open connections, in all
        self._per_uid: dict[int, int] = {}  # open connections per peer uid
        self._readers = 0  # open connections of peers that may not lease
        self.unsent = UnsentBytes()

    def register(self, op: str, handler: Handler, access: Access, verb: str = "") -> None:
        """Serve ``op`` with ``handler`` for callers ``access`` admits."""
        self.ops[op] = OpSpec(handler, access, verb)

    @property
    def bound(self) -> bool:
        return self._server is not None

    # -- the socket -------------------------------------------------------------------------

    async def bind(self) -> None:
        api = self.ctx.config.api
        check_socket_path(api.socket)
        access = socket_access(
            api, self.ctx.auth.accounts
        )  # before binding: an unknown group fails
        self._server = await asyncio.start_unix_server(
            self._serve_client, path=str(api.socket), limit=api.max_message_bytes
        )
        self.apply_socket_access(access)

    def apply_socket_access(self, access: tuple[int, int]) -> None:
        """Socket file mode and group (at start and on every reload)."""
        mode, gid = access
        api = self.ctx.config.api
        path = api.socket
        os.chown(path, -1, gid)
        path.chmod(mode)
        if mode == 0o660 and api.socket_group is None:
            others = [u for u in api.lease_users if u not in ("root", "0")] + api.lease_groups
            if others:
                log.warning(
                    "api.socket_private",
                    socket=str(path),
                    lease_users=others,
                    reason="status_public = false makes the socket 0660 with migd's own group, "
                    "so these lease users cannot connect",
                    hint="set api.socket_group to the group they share",
                )

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.ctx.config.api.socket.unlink()

    # -- connections ------------------------------------------------------------------------

    def _admit(self, peer: Peer, reader_only: bool) -> None:
        """Connection limits: nobody holds more than api.max_clients_per_uid connections,
        and users who may not lease never take the last quarter of api.max_clients, so
        lease users keep being served. Root is never refused."""
        api = self.ctx.config.api
        if peer.uid == 0:
            return
        held = self._per_uid.get(peer.uid, 0)
        if held > api.max_clients_per_uid:
            raise DaemonUnavailable(
                f"uid {peer.uid} holds {held - 1} connections to migd already "
                f"(api.max_clients_per_uid = {api.max_clients_per_uid})",
                hint="close idle connections and retry; `ss -xp | grep migd.sock` shows them",
            )
        if self._clients > api.max_clients or (
            reader_only and self._readers > api.max_clients - api.max_clients // 4
        ):
            raise DaemonUnavailable(
                f"migd has too many connections open ({self._clients - 1}, "
                f"api.max_clients = {api.max_clients})",
                hint="retry in a few seconds; `ss -xp | grep migd.sock` shows who holds them",
            )

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sock = writer.get_extra_info("socket")
        try:
            peer = Peer.from_socket(sock)
        except OSError:
            writer.close()
            return
        reader_only = peer.uid != 0 and not self.ctx.auth.may_lease(peer)
        # Counted from accept to close, whatever the client sends (nothing, too much, a
        # request): every open connection is one descriptor of its uid's allowance.
        self._clients += 1
        self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
        self._readers += int(reader_only)
        try:
            await self._serve_peer(peer, reader_only, reader, writer)
        finally:
            # Every path ends here: a client that connects and closes without a line
            # used to leave its descriptor open (an early return skipped the close).
            writer.close()
            self._clients -= 1
            self._readers -= int(reader_only)
            left = self._per_uid[peer.uid] - 1
            if left:
                self._per_uid[peer.uid] = left
            else:
                del self._per_uid[peer.uid]

    async def _serve_peer(
        self,
        peer: Peer,
        reader_only: bool,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        api = self.ctx.config.api
        try:
            self._admit(peer, reader_only)
        except MigdError as exc:
            await self._refuse(reader, writer, error_reply(None, exc))
            return
        try:
            # asyncio.timeout, not wait_for: wait_for wraps the read in a task of its own,
            # once per request (issue 26 §4); the timeout only arms a timer.
            async with asyncio.timeout(api.request_timeout_s):
                line = await reader.readline()
        except (ValueError, asyncio.LimitOverrunError):
            error = ProtocolError(f"message longer than {api.max_message_bytes} bytes")
            await self._refuse(reader, writer, error_reply(None, error))
            return
        except TimeoutError:
            error = ProtocolError(
                f"no complete request line within {api.request_timeout_s:g} s; closing",
                hint="send the request and its newline right after connecting",
            )
            await self._send(writer, error_reply(None, error))
            return
        except OSError:
            return
        if not line:
            return  # connected and closed without a request
        request_id: int | str | None = None
        try:
            request = decode_request(line)
            request_id = request.id
            if self.stopping.is_set():
                raise DaemonUnavailable("migd is stopping", hint="retry in a few seconds")
            # Before the reply is built: a user whose unread replies fill their budget
            # costs migd no more memory, and no loop time building replies to drop.
            refusal = self.unsent.refusal(peer.uid, api, api.max_reply_bytes)
            if refusal is not None:
                raise refusal
            began = self.ctx.clock.monotonic()
            result = await self.handle(request, peer, reader)
            reply = ok_reply(request_id, result)
            # Rarely larger than a page (status of a big node); refused if it does not fit.
            refusal = self.unsent.refusal(peer.uid, api, len(reply))
            if refusal is not None:
                raise refusal
            await self._send(writer, reply, peer.uid)
            self.ctx.latency_s[latency_class(request.op, result)].append(
                self.ctx.clock.monotonic() - began
            )
        except MigdError as exc:
            if not isinstance(exc, (ProtocolError, NotAuthorized, LeaseNotFound)):
                log.info("request.refused", error=exc.code, message=exc.message, peer_uid=peer.uid)
            await self._send(writer, error_reply(request_id, exc))
        except Exception as exc:  # never let one request take the daemon down
            log.exception("request.crashed", error=str(exc))
            await self._send(writer, error_reply(request_id, MigdError(f"internal error: {exc}")))

    async def _send(self, writer: asyncio.StreamWriter, data: bytes, uid: int = -1) -> None:
        """Write one reply and close. A client that does not read it within
        api.send_timeout_s is dropped: its transport is aborted, which frees what the
        daemon buffered for it (replies are bounded, and so is this wait).

        With ``uid``, the reply counts in :attr:`unsent` until the connection is closed
        or dropped (error replies are small and not counted).

        Every reply waits for the commit of what is written meanwhile: the state database
        commits the requests of one turn of the event loop together, after it
        (``StateDatabase.defer_commits``), and a client must not hear of a grant or a
        release that a crash could still lose. (A failed commit is the lease service's to
        retry; the reply then says what the books say, as before.) The reply is written
        *at* the commit, in its callback, not by this coroutine once it resumes: that is a
        turn later, after the loop has served every request that came in meanwhile, which
        put a whole turn's work into every reply's latency (issue 26 §4, paced p99)."""
        if uid >= 0:
            self.unsent.take(uid, len(data))
        try:
            whole: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

            def write() -> None:
                if not whole.done():  # (the request's task may have been cancelled)
                    whole.set_result(_write_whole(writer, data))

            store = self.ctx.store
            if store is None or not store.when_committed(write):
                write()
            if not await whole:
                await self._drain_and_close(writer)
        finally:
            if uid >= 0:
                self.unsent.give(uid, len(data))

    async def _drain_and_close(self, writer: asyncio.StreamWriter) -> None:
        """Wait (bounded) until a reply the kernel did not take whole has left, then close."""
        timeout = self.ctx.config.api.send_timeout_s
        try:
            await asyncio.wait_for(writer.drain(), timeout)
        except TimeoutError:
            log.info("client.dropped", reason=f"did not read its reply within {timeout:g} s")
            writer.transport.abort()
            return
        except OSError:
            writer.transport.abort()
            return
        # drain() returns once the buffer is below the high-water mark; what is left goes
        # out before the close. A client that stops reading there is dropped too: a
        # closing transport with unsent data otherwise keeps its buffer for ever.
        try:
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), timeout)
        except TimeoutError:
            log.info("client.dropped", reason=f"did not read its reply within {timeout:g} s")
            writer.transport.abort()
        except OSError:
            writer.transport.abort()

    async def _refuse(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: bytes
    ) -> None:
        """Answer a connection refused before its request was read, then read (and drop)
        the request it sends meanwhile before closing: a socket closed with unread data
        resets the peer (ECONNRESET), so a client reading to the end lost the reply."""
        with contextlib.suppress(OSError):
            writer.write(reply)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(writer.drain(), _REFUSAL_GRACE_S)
            if writer.can_write_eof():
                writer.write_eof()
        cap = 2 * self.ctx.config.api.max_message_bytes
        with contextlib.suppress(OSError, TimeoutError):
            # Bounded in time and bytes; what is read is dropped at once.
            await asyncio.wait_for(_discard(reader, cap), _REFUSAL_GRACE_S)

    async def handle(self, req: Request, peer: Peer, reader: asyncio.StreamReader) -> Any:
        """Check the op's declared access, then run its handler."""
        spec = self.ops.get(req.op)
        if spec is None:
            missing = self.missing.get(req.op)
            if missing is not None:
                raise missing(req.op)
            raise ProtocolError(f"unhandled op {req.op!r}")  # pragma: no cover
        auth = self.ctx.auth
        verb = spec.verb.format(op=req.op)
        lease = None
        if spec.access is Access.READ:
            auth.require_read(peer)
        elif spec.access is Access.LEASE:
            auth.require_lease(peer)
        elif spec.access is Access.ADMIN:
            auth.require_admin(peer, verb)
        elif spec.access is Access.OWNER:
            if not isinstance(req, (LeaseRef, ReportRequest)):  # pragma: no cover
                raise ProtocolError(f"op {req.op!r} names no lease; it cannot be OWNER")
            lease = self.lease_for(req.lease_id)
            auth.require_owner(peer, lease.owner_uid, verb)
        return await spec.handler(Call(req, peer, reader, lease))


def _write_whole(writer: asyncio.StreamWriter, data: bytes) -> bool:
    """Write ``data``; False when some of it waits in the transport's buffer (the caller
    drains it), True when nothing is left to wait for: the kernel took it whole (nearly
    always: a socket buffer holds far more than a reply) and the connection is closed,
    or the write failed and the transport was aborted.

    Taken whole, there is nothing to drain and nothing to wait for at the close: the
    transport closes itself on the loop's next pass: no drain and no wait for the close,
    each a wait_for task of its own, four per lease cycle (issue 26 §4)."""
    try:
        writer.write(data)
    except OSError:
        writer.transport.abort()
        return True
    if writer.transport.get_write_buffer_size():
        return False
    writer.close()
    return True


async def _discard(reader: asyncio.StreamReader, cap: int) -> None:
    """Read and drop up to ``cap`` bytes, or until the client closes its side."""
    got = 0
    while got < cap:
        chunk = await reader.read(65536)
        if not chunk:
            return
        got += len(chunk)


#: The simulator-only ops (:mod:`migd.daemon.api.sim_ops`, registered by ``main()`` on a
#: simulated node); elsewhere each is answered with :func:`not_simulated`.
SIM_ONLY_OPS = ("sim_attach", "sim_alloc", "sim_free", "sim_detach", "sim_xid")


def not_simulated(op: str) -> MigdError:
    return InvalidRequest(
        f"{op} exists only with the simulated backend",
        hint="start migd with --simulate for fake CUDA jobs",
    )


def latency_class(op: str, result: Any) -> str:
    """The latency series a reply counts in: leases that waited for capacity or for NVML
    to make their partition are kept apart from those granted at once."""
    if op == "lease" and isinstance(result, dict):
        if result.get("queued"):
            return "lease.queued"
        if result.get("prepared"):
            return "lease.prepared"
    return op


def socket_access(api: ApiSection, accounts: Accounts) -> tuple[int, int]:
    """The socket file's mode and group for an ``[api]`` section.

    Group names are looked up through the accounts port, as the access rules' are, so
    the answer follows the same cache (cleared on SIGHUP) and tests need no host group.

    ``0666`` when status is public or any user may lease (SO_PEERCRED decides who may
    do what); else ``0660``, group ``api.socket_group`` (migd's own group if unset).

    Raises:
        ConfigError: ``api.socket_group`` names no group on this host.
    """
    gid = os.getegid()
    if api.socket_group is not None:
        name = api.socket_group
        found = int(name) if name.isdigit() else accounts.group_id(name)
        if found is None:
            raise ConfigError(
                f"no group {name!r} on this host",
                where="api.socket_group",
                hint="name an existing group (getent group) or a numeric gid",
            )
        gid = found
    public = api.status_public or "*" in api.lease_users or "*" in api.lease_groups
    return (0o666 if public else 0o660), gid


def check_socket_path(path: Path) -> None:
    """Refuse a socket location another user could hijack.

    Every directory from ``/`` down to the socket's must be a real directory (no
    symlinked component: give the real path, e.g. ``/run``, not ``/var/run``) owned by
    root or by migd's user. The socket's own directory must not be writable by group
    or others at all; a directory above it may be, only if it is root's and sticky
    (``/tmp``: nobody can rename or replace what others put there). An existing socket
    must be stale (no daemon answers).

    Raises:
        ConfigError: the path is unsafe or another migd is running there.
    """
    where = "api.socket"
    path = Path(os.path.normpath(path.absolute()))  # not resolve(): symlinks must be seen
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=0o755, parents=True)
    # The rules every directory migd creates things in follows (migd.paths).
    check_directory_chain(parent, where, purpose="the socket")
    if path.is_symlink():
        raise ConfigError(f"{path} is a symlink; refusing to use it", where=where)
    if path.exists():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket", where=where)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale socket of a dead daemon
        else:
            raise ConfigError(
                f"another migd is already serving {path}",
                where=where,
                hint="stop it first (systemctl stop migd)",
            )
        finally:
            probe.close()
