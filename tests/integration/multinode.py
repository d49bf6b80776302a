"""A pool of several machines inside one chroot: an access point and N execute nodes.

The access point is a :class:`PersonalPool` without a startd (collector, negotiator,
schedd). Each execute node is its own ``condor_master`` (master + startd) and its own migd,
in its own mount namespace: ``/run/migd``, ``/var/lib/migd``, ``/etc/migd`` and
``/var/log/migd`` are bind mounts of the node's directory, so every node has the socket,
state and ``migd.toml`` at the paths the package and the shipped HTCondor configuration use,
exactly as on separate machines. migd comes from the installed ``.deb``; a node's
``/etc/migd/migd.toml`` is the packaged full example
(``/usr/share/doc/migd/migd.toml.example``, every key; the packaged ``/etc/migd/migd.toml``
is short) with documented keys edited (simulated GPUs, the users jobs run as). migd runs
under a restart loop, as ``Restart=on-failure`` in the systemd unit does, so a killed migd
comes back and adopts its leases.

Node-specific HTCondor settings (``LOCAL_DIR``, names, the collector's address file) are
``_CONDOR_*`` environment variables of the node's master; everything else comes from
``/usr/share/condor/config.d`` (the packages) and the pool's ``/etc/condor/config.d`` file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from condor_pool import (
    CHROOT_PATH,
    CondorChroot,
    PersonalPool,
    _log,
    _parse_json_ads,
    _pid_alive,
)

NODE_SCRIPT = "/usr/local/sbin/migd-test-node"
# Runs inside the node's mount namespace and chroot: migd under a restart loop (what
# systemd's Restart=on-failure does), then condor_master once migd answers (the startd
# reads its GPU inventory from migd at start, hence the unit's Before=condor.service).
NODE_SCRIPT_TEXT = r"""#!/bin/sh
node_dir=$1
(
    while [ ! -e "$node_dir/stop" ]; do
        /usr/bin/migd --config /etc/migd/migd.toml >>/var/log/migd/migd.log 2>&1 &
        echo $! > "$node_dir/migd.pid"
        wait $!
        echo "migd exited with $?" >>/var/log/migd/migd.log
        sleep 1
    done
) </dev/null &
i=0
until /usr/bin/migctl status >/dev/null 2>&1; do
    i=$((i + 1)); [ $i -gt 300 ] && { echo "migd did not answer" >&2; exit 1; }
    sleep 0.1
done
exec condor_master -f
"""

# Directories private to each node: (path on the node, subdirectory of the node dir, mode).
NODE_MOUNTS: tuple[tuple[str, str, int], ...] = (
    ("/run/migd", "run", 0o755),
    ("/var/lib/migd", "state", 0o700),
    ("/etc/migd", "etc", 0o755),
    ("/var/log/migd", "log", 0o755),
)


def edit_toml(text: str, section: str, values: Mapping[str, str]) -> str:
    """Set ``key = value`` (values already TOML) in ``[section]`` of the packaged file.

    Only keys the file already has are replaced (commented ``# key =`` lines too), so a
    knob that the package stops shipping fails loudly instead of being added silently.
    """
    out: list[str] = []
    current = ""
    todo = dict(values)
    for line in text.splitlines():
        header = re.match(r"^\[([^\]]+)\]\s*$", line)
        if header:
            current = header.group(1)
        match = re.match(r"^#?\s*([A-Za-z_]+)\s*=", line)
        if match and current == section and match.group(1) in todo:
            key = match.group(1)
            out.append(f"{key} = {todo.pop(key)}")
        else:
            out.append(line)
    if todo:
        raise KeyError(f"[{section}] of migd.toml has no keys {sorted(todo)}")
    return "\n".join(out) + "\n"


def node_name(slot: object) -> str:
    """The execute node of a slot name: ``slot1_2@ep2@vm`` (STARTD_NAME = ep2) -> ``ep2``."""
    parts = str(slot or "").split("@")
    return parts[1] if len(parts) >= 3 else parts[-1]


@dataclass
class ExecuteNode:
    """One execute machine: its own condor_master + startd and its own migd."""

    pool: MultiNodePool
    name: str
    gpus: str  # migd's backend.simulate, e.g. "2xA100-40GB" or "1xA100-40GB,1xA30-24GB"
    migd: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def dir(self) -> str:
        """The node's directory (chroot path, also visible inside the node)."""
        return f"{self.pool.ap.local_dir}-nodes/{self.name}"

    @property
    def socket(self) -> str:
        """migd's socket as seen from outside the node (the bind source)."""
        return f"{self.dir}/run/migd.sock"

    def start(self) -> None:
        ch = self.pool.chroot
        host = ch.path(self.dir)
        uid, gid = ch.ids("condor")
        for sub in ("condor", "condor/log", "condor/spool", "condor/execute", "condor/lock"):
            (host / sub).mkdir(parents=True, exist_ok=True)
            os.chown(host / sub, uid, gid)
        for node_path, sub, mode in NODE_MOUNTS:
            (host / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(host / sub, mode)
            ch.path(node_path).mkdir(parents=True, exist_ok=True)
        # every key at its default, as packaged (the conffile itself sets only a few)
        toml = ch.read_file("/usr/share/doc/migd/migd.toml.example")
        sections: dict[str, dict[str, str]] = {
            # the simulated GPUs keep their MIG layout across a migd restart, as real ones do
            "backend": {
                "kind": '"simulated"',
                "simulate": json.dumps(self.gpus),
                "sim_state_file": '"/var/lib/migd/simulated-gpus.json"',
            },
            "api": {"lease_users": '["root", "condor", "migdtest"]'},
        }
        for section, values in self.migd.items():
            sections.setdefault(section, {}).update(values)
        for section, values in sections.items():
            toml = edit_toml(toml, section, values)
        ch.write_file(f"{self.dir}/etc/migd.toml", toml)
        root = str(ch.root)
        binds = " && ".join(
            f"mount --bind {root}{self.dir}/{sub} {root}{node_path}"
            for node_path, sub, _ in NODE_MOUNTS
        )
        env = {
            "PATH": CHROOT_PATH,
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "_CONDOR_LOCAL_DIR": f"{self.dir}/condor",
            "_CONDOR_RUN": f"{self.dir}/condor/lock",
            "_CONDOR_DAEMON_LIST": "MASTER STARTD",
            "_CONDOR_USE_SHARED_PORT": "False",
            # the family session is per condor_master: another master's collector rejects it
            "_CONDOR_SEC_USE_FAMILY_SESSION": "False",
            "_CONDOR_MASTER_NAME": self.name,
            "_CONDOR_STARTD_NAME": self.name,
            "_CONDOR_COLLECTOR_ADDRESS_FILE": f"{self.pool.ap.local_dir}/log/.collector_address",
        }
        inner = ["chroot", root, "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items())]
        inner += [NODE_SCRIPT, self.dir]
        script = f"set -e; {binds}; exec " + shlex.join(inner)
        log = (host / "node.stderr").open("ab")
        with log:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def slots(self) -> list[dict[str, Any]]:
        return [ad for ad in self.pool.ap.status() if node_name(ad.get("Name")) == self.name]

    def ctl(self, *args: str, check: bool = True) -> Any:
        """migctl against this node's migd (JSON decoded with --json)."""
        proc = self.pool.chroot.run(
            ["migctl", "--socket", self.socket, *args], check=check, timeout=60
        )
        if proc.returncode != 0:
            return None
        return json.loads(proc.stdout) if "--json" in args else proc.stdout

    def leases(self, all_leases: bool = False) -> list[dict[str, Any]]:
        data = self.ctl("leases", "--json", *(["--all"] if all_leases else []), check=False)
        return list(data["leases"]) if data else []

    def migd_pid(self) -> int:
        return int(self.pool.chroot.read_file(f"{self.dir}/migd.pid").strip())

    def kill_migd(self, sig: signal.Signals = signal.SIGKILL) -> int:
        """Kill this node's migd (the restart loop starts it again); returns the old PID."""
        pid = self.migd_pid()
        os.kill(pid, sig)
        return pid

    def migd_log(self) -> str:
        path = self.pool.chroot.path(f"{self.dir}/log/migd.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        ch = self.pool.chroot
        ch.write_file(f"{self.dir}/stop", "")
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGQUIT)  # condor_master: fast shutdown
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        with contextlib.suppress(OSError, ValueError):
            pid = self.migd_pid()
            if _pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 20
                while _pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)

    def dump(self, limit: int = 6000) -> str:
        out = [f"===== node {self.name} ({self.gpus}) ====="]
        log_dir = self.pool.chroot.path(f"{self.dir}/condor/log")
        files = [self.pool.chroot.path(f"{self.dir}/node.stderr")]
        files += [log_dir / n for n in ("MasterLog", "StartLog")]
        files += sorted(log_dir.glob("StarterLog*"))
        for f in files:
            if f.is_file():
                text = f.read_text(errors="replace")
                out.append(f"----- {self.name}: {f.name} -----\n{text[-limit:]}")
        out.append(f"----- {self.name}: migd.log -----\n{self.migd_log()[-limit:]}")
        return "\n".join(out)


class MultiNodePool:
    """An access point (central manager + schedd) and execute nodes, one chroot."""

    def __init__(self, chroot: CondorChroot, name: str) -> None:
        self.chroot = chroot
        self.ap = PersonalPool(chroot, name)
        self.nodes: dict[str, ExecuteNode] = {}

    def start(
        self,
        nodes: Mapping[str, str],
        ap_config: str = "",
        *,
        migd: Mapping[str, Mapping[str, str]] | None = None,
        timeout: float = 90.0,
    ) -> MultiNodePool:
        """Start the access point, then the nodes ({name: GPUs}); wait for every startd."""
        self.chroot.write_file(NODE_SCRIPT, NODE_SCRIPT_TEXT, mode=0o755)
        t0 = time.monotonic()
        config = "DAEMON_LIST = MASTER COLLECTOR NEGOTIATOR SCHEDD\n" + ap_config
        self.ap.start(config, timeout=timeout, min_slots=0)
        self.chroot.run(["rm", "-rf", f"{self.ap.local_dir}-nodes"])
        for name, gpus in nodes.items():
            node = ExecuteNode(self, name, gpus, dict(migd or {}))
            self.nodes[name] = node
            node.start()

        def up() -> bool:
            for node in self.nodes.values():
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(f"node {node.name} exited\n{node.dump()}")
            names = {node_name(ad.get("Name")) for ad in self.ap.status()}
            return set(self.nodes) <= names

        self.ap.wait_for(up, timeout=timeout, what="every execute node's startd")
        _log(
            f"pool {self.ap.name}: AP + {len(self.nodes)} nodes up in {time.monotonic() - t0:.1f}s"
        )
        return self

    def stop(self) -> None:
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                node.stop()
        self.ap.stop()

    def __enter__(self) -> MultiNodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def dump_logs(self) -> str:
        return "\n".join([self.ap.dump_logs(), *(n.dump() for n in self.nodes.values())])

    def node_of(self, ad: Mapping[str, Any]) -> str:
        """The execute node a job ran on (from RemoteHost / LastRemoteHost)."""
        return node_name(ad.get("RemoteHost") or ad.get("LastRemoteHost"))

    def history(self, cluster: int, attrs: Sequence[str] = ()) -> list[dict[str, Any]]:
        cmd = ["condor_history", "-json", str(cluster)]
        if attrs:
            cmd += ["-attributes", ",".join(attrs)]
        proc = self.ap.condor(cmd, check=False)
        return _parse_json_ads(proc.stdout) if proc.returncode == 0 else []

    @contextlib.contextmanager
    def running(self) -> Iterator[MultiNodePool]:
        try:
            yield self
        finally:
            self.stop()
