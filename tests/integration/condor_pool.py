"""Real HTCondor personal pool in a Debian trixie chroot, for integration tests.

The harness builds (once) a ``debootstrap --variant=minbase trixie`` chroot with
Debian's ``condor`` package (23.9.x) and ``python3-venv``, caches it as a tarball
and restores it from there on later runs.  Inside the chroot it runs a personal
pool (``condor_master`` as root, jobs as the non-root user ``migdtest``) with a
configuration that works in this sandbox (no cgroups, no PID namespaces,
loopback only, host-based security).

Python use::

    chroot = CondorChroot()
    chroot.ensure_built()
    with chroot.mounted():
        with PersonalPool(chroot, "demo") as pool:
            pool.start("MACHINE_RESOURCE_VRAM = 81920")
            cluster = pool.submit({"executable": "/bin/true"})
            ads = pool.wait(cluster)

Command line (as root)::

    python tests/integration/condor_pool.py build [--force]
    python tests/integration/condor_pool.py shell [--user migdtest] [--pool]
    python tests/integration/condor_pool.py clean

Environment: ``MIGD_CONDOR_ROOT`` (chroot directory, default
``/var/tmp/migd-condor-chroot``), ``MIGD_CONDOR_CACHE`` (cache tarball, default
``~/.cache/migd/condor-trixie.tar.zst``), ``MIGD_DEBIAN_MIRROR``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

# --------------------------------------------------------------------------- #
# Recipe.  Bump RECIPE_VERSION (or change the package list) to force a rebuild
# of the chroot and of the cached tarball.
# --------------------------------------------------------------------------- #
RECIPE_VERSION = "3"
SUITE = "trixie"
PACKAGES: tuple[str, ...] = ("condor", "python3-venv", "procps")
TEST_USER = "migdtest"
TEST_UID = 4242
RECIPE = f"migd-condor-chroot v{RECIPE_VERSION} {SUITE} {' '.join(PACKAGES)} {TEST_USER}:{TEST_UID}"

DEFAULT_ROOT = Path("/var/tmp/migd-condor-chroot")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
MARKER = "etc/migd-chroot-recipe"  # relative to the chroot root
HOST_CA_BUNDLE = "/etc/migd-test/host-ca-bundle.crt"  # chroot path
CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CONDOR_CONFIG_FILE = "/etc/condor/config.d/99-migd-test"
POOLS_DIR = "/var/lib/migd-test"  # per-pool LOCAL_DIR parent (chroot path)
JOBS_DIR = "migd-jobs"  # under the submitting user's home
CONDOR_CHIRP = "/usr/libexec/condor/condor_chirp"

# Mounts made by CondorChroot.mount(): (target, fstype or "bind", source, options).
_MOUNTS: tuple[tuple[str, str, str, str], ...] = (
    ("proc", "proc", "proc", "nosuid,nodev,noexec"),
    ("sys", "sysfs", "sysfs", "ro,nosuid,nodev,noexec"),
    ("dev", "bind", "/dev", ""),
    ("dev/pts", "bind", "/dev/pts", ""),
    ("dev/shm", "tmpfs", "tmpfs", "mode=1777,nosuid,nodev"),
)

# Base configuration of every PersonalPool; extra_config is appended after it.
BASE_CONFIG = """\
# Written by tests/integration/condor_pool.py -- personal pool for migd tests.
use ROLE : Personal
CONDOR_HOST = 127.0.0.1
NETWORK_INTERFACE = 127.0.0.1
# gVisor-like sandboxes give the host an IPv6 address too; stay on IPv4 loopback,
# otherwise tools connect from fd00::x and host-based authorization denies them.
ENABLE_IPV6 = False
ENABLE_IPV4 = True

# Host-based security on loopback (overrides Debian's security:recommended_v9_0).
use SECURITY : HOST_BASED
SEC_DEFAULT_AUTHENTICATION = OPTIONAL
SEC_DEFAULT_ENCRYPTION = OPTIONAL
SEC_DEFAULT_INTEGRITY = OPTIONAL
ALLOW_READ = *
ALLOW_WRITE = 127.0.0.1
ALLOW_DAEMON = 127.0.0.1
ALLOW_NEGOTIATOR = 127.0.0.1
ALLOW_ADMINISTRATOR = 127.0.0.1

LOCAL_DIR = {local_dir}
LOG = $(LOCAL_DIR)/log
SPOOL = $(LOCAL_DIR)/spool
EXECUTE = $(LOCAL_DIR)/execute
LOCK = $(LOCAL_DIR)/lock
RUN = $(LOCAL_DIR)/run
COLLECTOR_ADDRESS_FILE = $(LOG)/.collector_address

# No shared port daemon: it would listen on the fixed port 9618, so a pool would depend on
# that port being free on the host, and two chroots could not each run a pool at once. Every
# daemon takes a free port; tools find the collector through COLLECTOR_ADDRESS_FILE.
USE_SHARED_PORT = False

# Sandbox: no bind mounts under the scratch dir, no PID namespaces, no cgroups.
MOUNT_UNDER_SCRATCH =
USE_PID_NAMESPACES = False
BASE_CGROUP =

# One partitionable slot, unless a drop-in read before this file (migd's 10-migd-execute.config
# with MIGD_SLOT_PER_GPU) already laid out the slots; pretend to be bigger than the 2-core test
# machine so that several small jobs can run at once.
NUM_CPUS = 8
MEMORY = 8192
if defined SLOT_TYPE_1
else
  use FEATURE : PartitionableSlot
endif

# Fast cycles so that a trivial job completes within seconds.
NEGOTIATOR_INTERVAL = 2
NEGOTIATOR_MIN_INTERVAL = 1
NEGOTIATOR_CYCLE_DELAY = 1
UPDATE_INTERVAL = 2
SCHEDD_INTERVAL = 2
SCHEDD_MIN_INTERVAL = 1
STARTER_UPDATE_INTERVAL = 2
SHADOW_QUEUE_UPDATE_INTERVAL = 2
STARTD_CRON_PERIOD_DEFAULT = 2
JOB_START_DELAY = 0
JOB_START_COUNT = 10
SHUTDOWN_GRACEFUL_TIMEOUT = 10
MASTER_UPDATE_INTERVAL = 5
# The schedd evaluates periodic holds (migd's too-big and loop-breaker holds) every
# PERIODIC_EXPR_INTERVAL, 60 s by default: a test of a hold would wait most of a minute.
PERIODIC_EXPR_INTERVAL = 5

ALL_DEBUG = D_FULLDEBUG
MAX_DEFAULT_LOG = 20000000
"""


class HarnessUnavailable(RuntimeError):
    """The machine cannot host the harness (not root, no debootstrap, no mirror...)."""


class ChrootCommandError(subprocess.CalledProcessError):
    """A command inside the chroot failed; str() includes its output."""

    def __str__(self) -> str:
        out = _tail(self.stdout or "", 3000)
        err = _tail(self.stderr or "", 3000)
        return f"{super().__str__()}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"


class PoolTimeout(TimeoutError):
    """A wait on the pool timed out; the message carries the last state seen."""


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def default_root() -> Path:
    return Path(os.environ.get("MIGD_CONDOR_ROOT") or DEFAULT_ROOT)


def default_cache() -> Path:
    env = os.environ.get("MIGD_CONDOR_CACHE")
    if env:
        return Path(env)
    suffix = ".tar.zst" if shutil.which("zstd") else ".tar.gz"
    return Path.home() / ".cache" / "migd" / f"condor-{SUITE}{suffix}"


def session_chroot(unavailable: Callable[[str], NoReturn]) -> Iterator[CondorChroot]:
    """The chroot at :func:`default_root`, built (or restored from the cache) and mounted
    for a test session, cleaned up after it; ``unavailable`` is called with the reason
    where this host cannot have it (the tiers' fixtures skip or fail there)."""
    chroot = CondorChroot(default_root())
    try:
        chroot.check_host()
        chroot.ensure_built(default_cache())
    except HarnessUnavailable as exc:
        unavailable(str(exc))
    chroot.mount()
    try:
        yield chroot
    finally:
        chroot.cleanup()


def _host_ca_bundle() -> Path | None:
    candidates = [
        os.environ.get("SSL_CERT_FILE"),
        os.environ.get("PIP_CERT"),
        ssl.get_default_verify_paths().cafile,
        "/etc/ssl/certs/ca-certificates.crt",
    ]
    for cand in candidates:
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


def _log(msg: str) -> None:
    print(f"[condor_pool {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _run_host(
    cmd: Sequence[str], *, timeout: float | None = None, check: bool = True, capture: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(cmd),
        text=True,
        timeout=timeout,
        check=False,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
    )
    if check and proc.returncode != 0:
        raise ChrootCommandError(proc.returncode, list(cmd), proc.stdout, "")
    return proc


def _unescape_mountinfo(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` (deepest first)."""
    base = str(path.resolve())
    found: list[str] = []
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            mnt = _unescape_mountinfo(line.split()[4])
            if mnt == base or mnt.startswith(base + "/"):
                found.append(mnt)
    return sorted(set(found), key=lambda m: (m.count("/"), m), reverse=True)


def processes_in(root: Path) -> list[int]:
    """PIDs of processes whose root directory is ``root`` (or below it)."""
    base = str(root.resolve())
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            proot = os.readlink(f"/proc/{entry}/root")
        except OSError:
            continue
        if proot == base or proot.startswith(base + "/"):
            pids.append(int(entry))
    return pids


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill_processes_in(
    root: Path, grace: float = 5.0, spare: frozenset[int] | set[int] = frozenset()
) -> list[int]:
    """SIGTERM, then SIGKILL, every process living in ``root`` (but ``spare``); returns PIDs."""
    seen: list[int] = []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = [p for p in processes_in(root) if _pid_alive(p) and p not in spare]
        if not pids:
            break
        seen.extend(p for p in pids if p not in seen)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.1)
    return seen


def _safe_rmtree(path: Path) -> None:
    """Remove a chroot tree, refusing to cross into anything still mounted."""
    if not path.exists():
        return
    for mnt in mounts_under(path):
        _umount(mnt)
    if mounts_under(path):
        raise RuntimeError(f"refusing to delete {path}: still has mounts {mounts_under(path)}")
    _run_host(["rm", "-rf", "--one-file-system", "--", str(path)], timeout=600)


def _umount(target: str) -> None:
    for args in (["umount", target], ["umount", "-l", target]):
        if subprocess.run(args, capture_output=True, check=False).returncode == 0:
            return
    raise RuntimeError(f"could not unmount {target}")


@contextlib.contextmanager
def _flock(path: Path, timeout: float = 3600.0) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lock {path} held by another process") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- #
# Chroot
# --------------------------------------------------------------------------- #
class CondorChroot:
    """A Debian trixie chroot with HTCondor, built once and cached as a tarball."""

    def __init__(self, root: Path | str | None = None, *, mirror: str | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        # Long-running helpers a test started in the chroot (e.g. migd) that a pool start
        # must not take for leftovers of an earlier pool.
        self.protected_pids: set[int] = set()
        self.mirror = mirror or os.environ.get("MIGD_DEBIAN_MIRROR") or DEFAULT_MIRROR
        self._mounted_by_us: list[str] = []

    # ---- paths ---------------------------------------------------------- #
    def path(self, chroot_path: str | os.PathLike[str]) -> Path:
        """Host path of a path inside the chroot."""
        rel = str(chroot_path).lstrip("/")
        return self.root / rel

    @property
    def lock_path(self) -> Path:
        return self.root.parent / f".{self.root.name}.lock"

    def is_built(self) -> bool:
        marker = self.path(MARKER)
        return marker.is_file() and marker.read_text(encoding="utf-8").strip() == RECIPE

    def packages_sound(self) -> bool:
        """Whether dpkg has every package of the chroot fully installed (``dpkg --audit``
        prints nothing); it reads the chroot's own database, so nothing needs mounting."""
        audit = _run_host(["dpkg", f"--root={self.root}", "--audit"], check=False, timeout=60)
        return audit.returncode == 0 and not audit.stdout.strip()

    # ---- preconditions -------------------------------------------------- #
    @staticmethod
    def check_host() -> None:
        """Raise HarnessUnavailable when this host cannot run the harness at all."""
        if sys.platform != "linux":
            raise HarnessUnavailable("the HTCondor chroot harness needs Linux")
        if os.geteuid() != 0:
            raise HarnessUnavailable(
                "the HTCondor chroot harness must run as root (chroot, mount, debootstrap)"
            )
        for tool in ("chroot", "mount", "umount", "tar"):
            if shutil.which(tool) is None:
                raise HarnessUnavailable(f"required host tool {tool!r} not found")

    def _ensure_host_tools(self, need_debootstrap: bool) -> None:
        missing = []
        if need_debootstrap and shutil.which("debootstrap") is None:
            missing.append("debootstrap")
        if shutil.which("zstd") is None:
            missing.append("zstd")
        if not missing:
            return
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        if shutil.which("apt-get") is None:
            if "debootstrap" in missing:
                raise HarnessUnavailable("debootstrap is not installed and apt-get is unavailable")
            return
        _log(f"installing host packages: {' '.join(missing)}")
        upd = subprocess.run(
            ["apt-get", "update", "-q"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=600,
        )
        inst = subprocess.run(
            ["apt-get", "install", "-y", "-q", *missing],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=900,
        )
        if need_debootstrap and shutil.which("debootstrap") is None:
            raise HarnessUnavailable(
                "debootstrap is missing and `apt-get install debootstrap` failed:\n"
                + _tail(upd.stdout + upd.stderr + inst.stdout + inst.stderr, 3000)
            )

    # ---- build / cache -------------------------------------------------- #
    def ensure_built(
        self,
        cache_tarball: Path | str | None = None,
        *,
        force: bool = False,
        use_cache: bool = True,
    ) -> str:
        """Make sure the chroot exists for the current RECIPE.

        Returns "present", "restored" (from the cache tarball) or "built".
        """
        self.check_host()
        cache = Path(cache_tarball) if cache_tarball is not None else default_cache()
        with _flock(self.lock_path):
            if not force and self.is_built():
                if self.packages_sound():
                    return "present"
                # A run stopped mid-install (Ctrl-C, a killed CI job) leaves packages
                # unpacked but not configured: every later install there fails. Start over
                # from the cache rather than make every test that installs migd fail.
                _log(f"{self.root}: packages left half-installed by an interrupted run")
                force = not (use_cache and self._cache_valid(cache))
            # Two chroots made at once (scripts/test.sh runs two) share the cache: the second
            # waits for the first to build and save it, then restores instead of building.
            with _flock(cache.with_name(cache.name + ".lock")):
                if use_cache and not force and self._cache_valid(cache):
                    t0 = time.monotonic()
                    self._restore(cache)
                    _log(f"restored {self.root} from {cache} in {time.monotonic() - t0:.1f}s")
                    return "restored"
                t0 = time.monotonic()
                self._build()
                _log(f"built {self.root} in {time.monotonic() - t0:.1f}s")
                if use_cache:
                    try:
                        self._save(cache)
                    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                        _log(f"warning: could not write cache {cache}: {exc}")
                return "built"

    @staticmethod
    def _recipe_file(cache: Path) -> Path:
        return cache.with_name(cache.name + ".recipe")

    def _cache_valid(self, cache: Path) -> bool:
        rf = self._recipe_file(cache)
        return cache.is_file() and rf.is_file() and rf.read_text(encoding="utf-8").strip() == RECIPE

    @staticmethod
    def _compress_flag(cache: Path) -> list[str]:
        if cache.name.endswith(".zst"):
            if shutil.which("zstd") is None:
                raise HarnessUnavailable(f"{cache} needs zstd, which is not installed")
            return ["--use-compress-program", "zstd -T0 -3 -q"]
        if cache.name.endswith(".gz"):
            return ["-z"]
        return []

    def _restore(self, cache: Path) -> None:
        self.unmount()
        kill_processes_in(self.root)
        _safe_rmtree(self.root)
        tmp = self.root.with_name(self.root.name + ".restore")
        _safe_rmtree(tmp)
        tmp.mkdir(parents=True)
        _run_host(
            [
                "tar",
                "-C",
                str(tmp),
                "--numeric-owner",
                "-xpf",
                str(cache),
                *self._compress_flag(cache),
            ],
            timeout=900,
        )
        tmp.rename(self.root)
        if not self.is_built():
            raise RuntimeError(f"cache {cache} restored but the recipe marker does not match")

    def _save(self, cache: Path) -> None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmpname = tempfile.mkstemp(prefix=cache.name + ".", suffix=".part", dir=cache.parent)
        os.close(fd)
        try:
            t0 = time.monotonic()
            _run_host(
                [
                    "tar",
                    "-C",
                    str(self.root),
                    "--numeric-owner",
                    "--one-file-system",
                    "-cpf",
                    tmpname,
                    *self._compress_flag(cache),
                    "--exclude=./proc/*",
                    "--exclude=./sys/*",
                    "--exclude=./dev/pts/*",
                    "--exclude=./dev/shm/*",
                    "--exclude=./tmp/*",
                    f"--exclude=.{POOLS_DIR}/*",
                    ".",
                ],
                timeout=900,
            )
            os.replace(tmpname, cache)
            self._recipe_file(cache).write_text(RECIPE + "\n", encoding="utf-8")
            size = cache.stat().st_size / 2**20
            _log(f"cached chroot as {cache} ({size:.0f} MiB) in {time.monotonic() - t0:.1f}s")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmpname)

    def _build(self) -> None:
        self._ensure_host_tools(need_debootstrap=True)
        self.unmount()
        kill_processes_in(self.root)
        build = CondorChroot(self.root.with_name(self.root.name + ".build"), mirror=self.mirror)
        build.unmount()
        _safe_rmtree(build.root)
        build.root.parent.mkdir(parents=True, exist_ok=True)
        _log(f"debootstrap {SUITE} into {build.root} (mirror {self.mirror})")
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", SUITE, str(build.root), self.mirror],
            capture_output=True,
            text=True,
            check=False,
            timeout=1800,
        )
        if proc.returncode != 0:
            log = build.root / "debootstrap" / "debootstrap.log"
            detail = log.read_text(errors="replace") if log.is_file() else ""
            with contextlib.suppress(OSError, RuntimeError, subprocess.SubprocessError):
                _safe_rmtree(build.root)
            raise HarnessUnavailable(
                f"debootstrap {SUITE} failed (rc={proc.returncode}); is {self.mirror} reachable?\n"
                + _tail(proc.stdout + proc.stderr + detail, 4000)
            )
        try:
            build.mount()
            env = {"DEBIAN_FRONTEND": "noninteractive"}
            _log(f"apt-get install {' '.join(PACKAGES)}")
            build.run(["apt-get", "update", "-q"], env=env, timeout=900)
            build.run(
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                env=env,
                timeout=1800,
            )
            build.run(["apt-get", "clean"], env=env)
            build.run(
                [
                    "useradd",
                    "--create-home",
                    "--uid",
                    str(TEST_UID),
                    "--user-group",
                    "--shell",
                    "/bin/bash",
                    TEST_USER,
                ]
            )
            build.run(["mkdir", "-p", POOLS_DIR, "/etc/migd-test"])
            version = build.run(["condor_version"]).stdout
            build.path("etc/migd-test/condor_version").write_text(version, encoding="utf-8")
        finally:
            build.unmount()
        for lists in (build.root / "var/lib/apt/lists").glob("*_dists_*"):
            lists.unlink()
        build.path(MARKER).write_text(RECIPE + "\n", encoding="utf-8")
        _safe_rmtree(self.root)
        build.root.rename(self.root)

    # ---- mounts --------------------------------------------------------- #
    def mount(self) -> None:
        """Mount proc, sys (ro), dev, dev/pts and a private dev/shm; idempotent."""
        if not self.root.is_dir():
            raise RuntimeError(f"{self.root} does not exist; call ensure_built() first")
        existing = set(mounts_under(self.root))
        try:
            for target, fstype, source, options in _MOUNTS:
                tpath = self.root / target
                if str(tpath.resolve()) in existing:
                    continue
                tpath.mkdir(parents=True, exist_ok=True)
                if fstype == "bind":
                    cmd = ["mount", "--bind", source, str(tpath)]
                else:
                    cmd = ["mount", "-t", fstype, "-o", options, source, str(tpath)]
                _run_host(cmd, timeout=30)
                self._mounted_by_us.append(str(tpath))
            self._sync_host_files()
        except BaseException:
            self.unmount()
            raise

    def _sync_host_files(self) -> None:
        """DNS, hosts and CA bundle from the host, so that name lookups and
        apt/pip inside the chroot work as on the host."""
        for name in ("resolv.conf", "hosts", "hostname"):
            src = Path("/etc") / name
            if src.is_file():
                dst = self.path(f"etc/{name}")
                if dst.is_symlink():
                    dst.unlink()
                shutil.copyfile(src, dst)
        bundle = _host_ca_bundle()
        if bundle is not None:
            dst = self.path(HOST_CA_BUNDLE)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(bundle, dst)

    def unmount(self) -> None:
        """Unmount everything below the root (lazy fallback); idempotent."""
        if not self.root.exists():
            return
        for mnt in mounts_under(self.root):
            if mnt == str(self.root.resolve()):
                continue
            _umount(mnt)
        self._mounted_by_us.clear()

    def is_mounted(self) -> bool:
        return str(self.path("proc").resolve()) in mounts_under(self.root)

    @contextlib.contextmanager
    def mounted(self) -> Iterator[CondorChroot]:
        self.mount()
        try:
            yield self
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Kill every process inside the chroot, then unmount."""
        kill_processes_in(self.root)
        self.unmount()

    # ---- commands ------------------------------------------------------- #
    def user_home(self, user: str) -> str:
        return "/root" if user == "root" else f"/home/{user}"

    def command(
        self,
        cmd: Sequence[str],
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> list[str]:
        """argv (for the host) that runs ``cmd`` inside the chroot with a clean env."""
        who = user or "root"
        home = self.user_home(who)
        full_env = {
            "PATH": CHROOT_PATH,
            "HOME": home,
            "USER": who,
            "LOGNAME": who,
            "LANG": "C.UTF-8",
            "TERM": os.environ.get("TERM", "dumb"),
        }
        full_env.update(env or {})
        argv = ["chroot", str(self.root), "/usr/bin/env", "-i"]
        argv += ["-C", cwd or (home if user else "/")]
        argv += [f"{k}={v}" for k, v in full_env.items()]
        if user and user != "root":
            argv += ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--"]
        return argv + list(cmd)

    def run(
        self,
        cmd: Sequence[str],
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = True,
        timeout: float | None = 300,
        cwd: str | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside the chroot (as root, or as ``user`` via setpriv)."""
        argv = self.command(cmd, user=user, env=env, cwd=cwd)
        proc = subprocess.run(
            argv,
            text=True,
            capture_output=True,
            timeout=timeout,
            input=input,
            check=False,
            start_new_session=True,
        )
        if check and proc.returncode != 0:
            raise ChrootCommandError(proc.returncode, list(cmd), proc.stdout, proc.stderr)
        return proc

    def shell(self, user: str | None = None) -> int:
        """Interactive bash inside the chroot (for humans)."""
        argv = self.command(
            ["bash", "-l"],
            user=user,
            env={"PS1": f"(migd-condor{'/' + user if user else ''}) \\w\\$ "},
        )
        return subprocess.call(argv)

    # ---- files ---------------------------------------------------------- #
    def _chown(self, host_path: Path, owner: str | None) -> None:
        if owner is not None:
            uid, gid = self.ids(owner)
            os.chown(host_path, uid, gid)

    def ids(self, user: str) -> tuple[int, int]:
        """uid/gid of a user of the chroot (from the chroot's /etc/passwd)."""
        for line in self.path("etc/passwd").read_text(encoding="utf-8").splitlines():
            fields = line.split(":")
            if fields[0] == user:
                return int(fields[2]), int(fields[3])
        raise KeyError(f"no user {user!r} in the chroot")

    def write_file(
        self, chroot_path: str, content: str, *, mode: int = 0o644, owner: str | None = None
    ) -> Path:
        """Write a text file inside the chroot (parents created root-owned 0755)."""
        dst = self.path(chroot_path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
        tmp.write_text(content, encoding="utf-8")
        os.chmod(tmp, mode)
        self._chown(tmp, owner)
        os.replace(tmp, dst)
        return dst

    def read_file(self, chroot_path: str) -> str:
        return self.path(chroot_path).read_text(encoding="utf-8", errors="replace")

    def copy_in(
        self, src: Path | str, dst: str, *, owner: str | None = None, ignore: Sequence[str] = ()
    ) -> Path:
        """Copy a host file or directory to ``dst`` (a chroot path)."""
        src = Path(src)
        target = self.path(dst)
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(
                src,
                target,
                symlinks=True,
                ignore=shutil.ignore_patterns(*ignore) if ignore else None,
            )
            if owner is not None:
                for p in [target, *target.rglob("*")]:
                    if not p.is_symlink():
                        self._chown(p, owner)
        else:
            shutil.copy2(src, target)
            self._chown(target, owner)
        return target

    # ---- python --------------------------------------------------------- #
    def pip_env(self) -> dict[str, str]:
        """Environment for pip inside the chroot (host CA bundle: TLS proxies)."""
        env = {
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_DEFAULT_TIMEOUT": "120",
            "PIP_NO_INPUT": "1",
        }
        if self.path(HOST_CA_BUNDLE).is_file():
            # pip >= 24.2 uses truststore (system store) and ignores PIP_CERT for it;
            # SSL_CERT_FILE is honoured by both code paths.
            env["SSL_CERT_FILE"] = HOST_CA_BUNDLE
            env["PIP_CERT"] = HOST_CA_BUNDLE
        for key in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
            urls = [u for u in os.environ.get(key, "").split() if u.startswith(("http:", "https:"))]
            if urls:
                env[key] = " ".join(urls)
        return env

    def ensure_venv(self, venv: str = "/opt/migd-venv") -> str:
        if not self.path(f"{venv}/bin/python").exists():
            self.run(["python3", "-m", "venv", venv], timeout=300)
        return venv

    def install_python_package(
        self,
        source: Path | str,
        venv: str = "/opt/migd-venv",
        extra_args: Sequence[str] = (),
        timeout: float = 900,
    ) -> str:
        """pip-install a project directory, sdist or wheel into a venv in the chroot.

        Dependencies come from PyPI (the chroot shares the host network).
        Returns the venv path (chroot path).
        """
        source = Path(source).resolve()
        self.ensure_venv(venv)
        if source.is_dir():
            dst = f"/opt/migd-src/{source.name}"
            self.copy_in(
                source,
                dst,
                ignore=(
                    ".venv",
                    ".git",
                    "__pycache__",
                    "*.egg-info",
                    "build",
                    "dist",
                    ".mypy_cache",
                    ".ruff_cache",
                    ".pytest_cache",
                    ".tox",
                    ".nox",
                ),
            )
        else:
            dst = f"/opt/migd-src/{source.name}"
            self.copy_in(source, dst)
        self.run(
            [f"{venv}/bin/pip", "install", *extra_args, dst], env=self.pip_env(), timeout=timeout
        )
        return venv


# --------------------------------------------------------------------------- #
# Personal pool
# --------------------------------------------------------------------------- #
JOB_STATUS = {
    1: "Idle",
    2: "Running",
    3: "Removed",
    4: "Completed",
    5: "Held",
    6: "Transferring Output",
    7: "Suspended",
}


def _format_submit(description: Mapping[str, Any] | str) -> str:
    if isinstance(description, str):
        text = textwrap.dedent(description).strip() + "\n"
        if not re.search(r"^\s*queue\b", text, re.MULTILINE | re.IGNORECASE):
            text += "queue\n"
        return text
    desc = {
        "output": "out.$(Cluster).$(Process)",
        "error": "err.$(Cluster).$(Process)",
        "log": "job.log",
        "request_memory": "64",
        "request_disk": "1024",
    }
    lower = {k.lower() for k in description}
    desc = {k: v for k, v in desc.items() if k not in lower}
    desc.update({k: v for k, v in description.items() if k.lower() != "queue"})
    lines = [f"{k} = {v}" for k, v in desc.items()]
    queue = description.get("queue", description.get("Queue", ""))
    lines.append(f"queue {queue}".rstrip())
    return "\n".join(lines) + "\n"


def _parse_json_ads(text: str) -> list[dict[str, Any]]:
    text = text.strip()
    if not text:
        return []
    data = json.loads(text)
    if isinstance(data, dict):
        return [data]
    return list(data)


class PersonalPool:
    """A personal HTCondor pool running inside a mounted CondorChroot.

    Only one pool can run per chroot at a time (they share /etc/condor/config.d).
    """

    def __init__(self, chroot: CondorChroot, name: str = "pool") -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"bad pool name {name!r}")
        self.chroot = chroot
        self.name = name
        self.local_dir = f"{POOLS_DIR}/{name}"
        self.config_text = ""
        self._config_files: list[str] = []
        self._master: subprocess.Popen[bytes] | None = None
        self._lock_cm: contextlib.AbstractContextManager[None] | None = None
        self._job_dirs: dict[int, tuple[str, str]] = {}  # cluster -> (user, dir)
        self._seq = 0

    # ---- lifecycle ------------------------------------------------------ #
    @property
    def log_dir(self) -> Path:
        return self.chroot.path(f"{self.local_dir}/log")

    def start(
        self,
        extra_config: str = "",
        *,
        config_files: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        min_slots: int = 1,
    ) -> PersonalPool:
        """Write the config and start condor_master; wait for a slot and the schedd.

        ``config_files`` maps names to contents of extra files for
        /etc/condor/config.d (removed again by stop()).
        """
        if self._master is not None:
            raise RuntimeError("pool already started")
        if not self.chroot.is_mounted():
            raise RuntimeError("the chroot is not mounted")
        lock = _flock(self.chroot.root.parent / f".{self.chroot.root.name}.pool.lock", timeout)
        lock.__enter__()
        self._lock_cm = lock
        try:
            self._start(extra_config, config_files or {}, timeout, min_slots)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(
        self, extra_config: str, config_files: Mapping[str, str], timeout: float, min_slots: int
    ) -> None:
        spare = self.chroot.protected_pids
        stale = [p for p in processes_in(self.chroot.root) if _pid_alive(p) and p not in spare]
        if stale:
            _log(f"killing stale processes in the chroot: {stale}")
            kill_processes_in(self.chroot.root, spare=spare)
        ch = self.chroot
        local = ch.path(self.local_dir)
        _safe_rmtree(local)
        uid, gid = ch.ids("condor")
        for sub in ("", "log", "spool", "execute", "lock", "run"):
            d = local / sub
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, uid, gid)
            os.chmod(d, 0o755)
        jobs = ch.path(f"{ch.user_home(TEST_USER)}/{JOBS_DIR}/{self.name}")
        if jobs.exists():
            shutil.rmtree(jobs)
        for cfg in ch.path("etc/condor/config.d").glob("9?-migd-test*"):
            cfg.unlink()
        self.config_text = (
            BASE_CONFIG.format(local_dir=self.local_dir)
            + "\n# --- extra ---\n"
            + textwrap.dedent(extra_config).strip()
            + "\n"
        )
        ch.write_file(CONDOR_CONFIG_FILE, self.config_text)
        for fname, content in config_files.items():
            path = f"/etc/condor/config.d/{fname}"
            ch.write_file(path, content)
            self._config_files.append(path)
        # Validate the config before starting anything.
        ch.run(["condor_config_val", "LOCAL_DIR"], timeout=30)
        errf = open(local / "log" / "master.stderr", "wb")  # noqa: SIM115
        with errf:
            self._master = subprocess.Popen(
                ch.command(["condor_master", "-f"]),
                stdin=subprocess.DEVNULL,
                stdout=errf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        t0 = time.monotonic()

        def ready() -> bool:
            if self._master is not None and self._master.poll() is not None:
                raise RuntimeError(
                    f"condor_master exited with {self._master.returncode}\n" + self.dump_logs()
                )
            if not (local / "log" / ".collector_address").exists():
                return False
            slots = self.status()
            if len(slots) < min_slots:
                return False
            if not self.status("-schedd"):
                return False
            return self.chroot.run(["condor_q", "-totals"], check=False, timeout=30).returncode == 0

        self.wait_for(ready, timeout=timeout, what="pool start (slot + schedd advertised)")
        _log(f"pool {self.name} up in {time.monotonic() - t0:.1f}s")

    def stop(self, timeout: float = 20.0) -> None:
        """Fast-shutdown condor_master, then kill anything left in the chroot."""
        try:
            master = self._master
            if master is not None and master.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    master.send_signal(signal.SIGQUIT)  # fast shutdown of all daemons
                try:
                    master.wait(timeout)
                except subprocess.TimeoutExpired:
                    master.kill()
                    master.wait(10)
            self._master = None
            left = kill_processes_in(self.chroot.root, grace=3.0)
            if left:
                _log(f"killed leftover processes in the chroot: {left}")
            for path in self._config_files:
                with contextlib.suppress(FileNotFoundError):
                    self.chroot.path(path).unlink()
            self._config_files.clear()
        finally:
            if self._lock_cm is not None:
                lock, self._lock_cm = self._lock_cm, None
                lock.__exit__(None, None, None)

    def is_running(self) -> bool:
        return self._master is not None and self._master.poll() is None

    def __enter__(self) -> PersonalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reconfig(self, extra_config: str | None = None) -> None:
        """Rewrite the extra config (if given) and run condor_reconfig."""
        if extra_config is not None:
            self.config_text = (
                BASE_CONFIG.format(local_dir=self.local_dir)
                + "\n# --- extra ---\n"
                + textwrap.dedent(extra_config).strip()
                + "\n"
            )
            self.chroot.write_file(CONDOR_CONFIG_FILE, self.config_text)
        self.condor(["condor_reconfig"])

    # ---- generic helpers ------------------------------------------------ #
    def condor(
        self,
        cmd: Sequence[str],
        user: str | None = None,
        check: bool = True,
        timeout: float = 60,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run an HTCondor tool inside the chroot."""
        return self.chroot.run(cmd, user=user, check=check, timeout=timeout, cwd=cwd)

    @staticmethod
    def wait_for(
        predicate: Callable[[], Any],
        timeout: float = 60.0,
        interval: float = 0.5,
        what: str = "condition",
        state: Callable[[], str] | None = None,
    ) -> Any:
        """Poll ``predicate`` until it returns a truthy value, which is returned."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                extra = ""
                if state is not None:
                    with contextlib.suppress(Exception):
                        extra = "\nlast state:\n" + state()
                raise PoolTimeout(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
            time.sleep(interval)

    # ---- jobs ----------------------------------------------------------- #
    def new_job_dir(self, user: str = TEST_USER) -> str:
        """A fresh directory (chroot path) owned by ``user`` for a submission."""
        self._seq += 1
        home = self.chroot.user_home(user)
        path = f"{home}/{JOBS_DIR}/{self.name}/{self._seq:03d}"
        host = self.chroot.path(path)
        if host.exists():
            shutil.rmtree(host)
        uid, gid = self.chroot.ids(user)
        cur = self.chroot.path(home)
        for part in Path(path).relative_to(home).parts:
            cur = cur / part
            cur.mkdir(exist_ok=True)
            os.chown(cur, uid, gid)
        return path

    def submit(
        self,
        description: Mapping[str, Any] | str,
        user: str = TEST_USER,
        files: Mapping[str, str] | None = None,
    ) -> int:
        """condor_submit as ``user`` from a fresh job dir; returns the cluster id.

        A dict gets defaults for output/error/log (in the job dir), request_memory
        and request_disk, and ``queue`` (use key "queue" for e.g. "3").  ``files``
        are written (mode 0755, owned by the user) into the job dir first.
        """
        jobdir = self.new_job_dir(user)
        for fname, content in (files or {}).items():
            self.chroot.write_file(f"{jobdir}/{fname}", content, mode=0o755, owner=user)
        self.chroot.write_file(f"{jobdir}/job.sub", _format_submit(description), owner=user)
        proc = self.condor(["condor_submit", "job.sub"], user=user, cwd=jobdir)
        match = re.search(r"submitted to cluster (\d+)", proc.stdout)
        if not match:
            raise RuntimeError(f"cannot parse condor_submit output:\n{proc.stdout}\n{proc.stderr}")
        cluster = int(match.group(1))
        self._job_dirs[cluster] = (user, jobdir)
        return cluster

    def job_dir(self, cluster: int) -> str:
        return self._job_dirs[cluster][1]

    def job_file(self, cluster: int, name: str) -> str:
        """Content of a file in the cluster's job dir ('' when missing)."""
        path = self.chroot.path(f"{self.job_dir(cluster)}/{name}")
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def job_output(self, cluster: int, proc: int = 0) -> str:
        return self.job_file(cluster, f"out.{cluster}.{proc}")

    def job_error(self, cluster: int, proc: int = 0) -> str:
        return self.job_file(cluster, f"err.{cluster}.{proc}")

    def user_log(self, cluster: int) -> str:
        return self.job_file(cluster, "job.log")

    def q(
        self, cluster: int | None = None, constraint: str | None = None, attrs: Sequence[str] = ()
    ) -> list[dict[str, Any]]:
        """Job ads in the queue (all users), as dicts."""
        cmd = ["condor_q", "-allusers", "-json"]
        if cluster is not None:
            cmd.append(str(cluster))
        if constraint:
            cmd += ["-constraint", constraint]
        if attrs:
            cmd += ["-attributes", ",".join(attrs)]
        return _parse_json_ads(self.condor(cmd).stdout)

    def history(
        self, cluster: int | None = None, constraint: str | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Job ads from the schedd's history file, newest first."""
        cmd = ["condor_history", "-json"]
        if cluster is not None:
            cmd.append(str(cluster))
        if constraint:
            cmd += ["-constraint", constraint]
        if limit is not None:
            cmd += ["-limit", str(limit)]
        proc = self.condor(cmd, check=False)
        if proc.returncode != 0 and "No such file" not in proc.stderr:
            raise ChrootCommandError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return _parse_json_ads(proc.stdout)

    def status(self, *args: str, constraint: str | None = None) -> list[dict[str, Any]]:
        """``condor_status -json [args]`` (default: slot ads) as dicts."""
        cmd = ["condor_status", "-json", *args]
        if constraint:
            cmd += ["-constraint", constraint]
        proc = self.condor(cmd, check=False)
        if proc.returncode != 0:
            return []
        return _parse_json_ads(proc.stdout)

    def startd_ads(self) -> list[dict[str, Any]]:
        """Slot ads straight from the startd (no collector delay)."""
        proc = self.condor(["condor_status", "-direct", "127.0.0.1", "-json"], check=False)
        return _parse_json_ads(proc.stdout) if proc.returncode == 0 else self.status()

    def rm(self, cluster: int, user: str | None = None) -> None:
        self.condor(["condor_rm", str(cluster)], user=user)

    def hold(self, cluster: int, reason: str | None = None) -> None:
        self.condor(["condor_hold", *(["-reason", reason] if reason else []), str(cluster)])

    def release(self, cluster: int) -> None:
        self.condor(["condor_release", str(cluster)])

    def wait(
        self,
        cluster: int,
        timeout: float = 120.0,
        until: Callable[[list[dict[str, Any]]], bool] | None = None,
        interval: float = 0.5,
    ) -> list[dict[str, Any]]:
        """Wait until all jobs of ``cluster`` left the queue or are held.

        Returns the job ads: from history for jobs that left, from the queue for
        held ones (or, with ``until``, the queue ads for which ``until`` is true).
        """
        last: list[dict[str, Any]] = []

        def check() -> list[dict[str, Any]] | None:
            nonlocal last
            queue = self.q(cluster)
            last = queue
            if until is not None:
                return queue if until(queue) else None
            if queue and all(ad.get("JobStatus") == 5 for ad in queue):
                return queue
            if queue:
                return None
            hist = self.history(cluster)
            return hist or None

        def state() -> str:
            return self.describe(last)

        result: list[dict[str, Any]] = self.wait_for(
            check,
            timeout=timeout,
            interval=interval,
            what=f"cluster {cluster} to finish",
            state=state,
        )
        return sorted(result, key=lambda ad: int(ad.get("ProcId", 0)))

    @staticmethod
    def describe(ads: Sequence[Mapping[str, Any]]) -> str:
        keys = (
            "ClusterId",
            "ProcId",
            "JobStatus",
            "NumJobStarts",
            "NumShadowStarts",
            "NumJobCompletions",
            "ExitCode",
            "HoldReason",
            "LastHoldReason",
            "LastRejMatchReason",
            "RemoteHost",
        )
        lines = []
        for ad in ads:
            parts = [f"{k}={ad[k]!r}" for k in keys if k in ad]
            lines.append(" ".join(parts))
        return "\n".join(lines) or "(no ads)"

    # ---- diagnostics ---------------------------------------------------- #
    def dump_logs(self, max_chars_per_file: int = 6000) -> str:
        """Tails of the daemon logs, the config and the job files, for failure reports."""
        out: list[str] = [f"===== pool {self.name} ({self.local_dir}) ====="]
        out.append("----- " + CONDOR_CONFIG_FILE + " -----\n" + self.config_text)
        log_dir = self.log_dir
        if log_dir.is_dir():
            order = [
                "master.stderr",
                "MasterLog",
                "SchedLog",
                "ShadowLog",
                "StartLog",
                "NegotiatorLog",
                "CollectorLog",
            ]
            files = [log_dir / n for n in order if (log_dir / n).is_file()]
            files += sorted(p for p in log_dir.glob("StarterLog*") if p.is_file())
            for f in files:
                text = f.read_text(encoding="utf-8", errors="replace")
                out.append(f"----- {f.name} -----\n{_tail(text, max_chars_per_file)}")
        for cluster, (_user, jobdir) in sorted(self._job_dirs.items()):
            host_dir = self.chroot.path(jobdir)
            if not host_dir.is_dir():
                continue
            for f in sorted(host_dir.iterdir()):
                if f.is_file() and f.stat().st_size < 10_000_000:
                    text = f.read_text(encoding="utf-8", errors="replace")
                    out.append(
                        f"----- cluster {cluster}: {jobdir}/{f.name} -----\n"
                        + _tail(text, max_chars_per_file)
                    )
        return "\n".join(out)

    def log_text(self, name: str) -> str:
        """Full text of one daemon log (e.g. "StartLog"), or of all matching a glob."""
        parts = []
        for f in sorted(self.log_dir.glob(name)):
            parts.append(f.read_text(encoding="utf-8", errors="replace"))
        return "\n".join(parts)


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #
def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=None, help="chroot dir")
    parser.add_argument("--cache", type=Path, default=None, help="cache tarball")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or restore) the chroot and cache it")
    b.add_argument("--force", action="store_true", help="rebuild from scratch")
    b.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    s = sub.add_parser("shell", help="mount the chroot and open a shell inside it")
    s.add_argument("--user", default=None, help=f"e.g. {TEST_USER} (default root)")
    s.add_argument("--pool", action="store_true", help="start a personal pool first")
    s.add_argument("--config", default="", help="extra pool config (with --pool)")
    sub.add_parser("clean", help="kill processes in the chroot and unmount it")
    sub.add_parser("info", help="print paths, recipe and state")
    args = parser.parse_args(argv)

    chroot = CondorChroot(args.root)
    if args.cmd == "build":
        how = chroot.ensure_built(args.cache, force=args.force, use_cache=not args.no_cache)
        print(f"{how}: {chroot.root}")
        return 0
    if args.cmd == "clean":
        killed = kill_processes_in(chroot.root)
        chroot.unmount()
        print(f"killed {killed}; mounts left: {mounts_under(chroot.root)}")
        return 0
    if args.cmd == "info":
        print(f"root:   {chroot.root} (built for this recipe: {chroot.is_built()})")
        print(f"cache:  {args.cache or default_cache()}")
        print(f"recipe: {RECIPE}")
        print(f"mounts: {mounts_under(chroot.root) if chroot.root.exists() else []}")
        return 0
    chroot.ensure_built(args.cache)
    with chroot.mounted():
        if args.pool:
            with PersonalPool(chroot, "shell") as pool:
                pool.start(args.config)
                print(f"pool up; logs in {pool.local_dir}/log; submit as {TEST_USER}")
                return chroot.shell(args.user)
        return chroot.shell(args.user)


if __name__ == "__main__":
    sys.exit(_main())
