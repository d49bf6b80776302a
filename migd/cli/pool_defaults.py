"""``migctl pool-defaults``: the access point's GPU memory defaults, from the pool.

A fixed ``MIGD_MAX_VRAM`` strands jobs (issue 22 §8): in a pool of 40 GB A100s a job
that states no GPU memory got 81920 MiB and matched nothing, forever Idle; on an H200
larger jobs were held although a node could run them. Every migd node advertises
``MigdMaxVRAM`` (the largest partition it can ever give one job) and ``MigdServes``
(the ``+MigdMode`` values its GPUs serve) in its slot ads (``condor-ad``). Run on the
access point as a ``SCHEDD_CRON`` job (``condor_config/20-migd-access-point.config``),
this asks the collector for them, writes ``MIGD_POOL_MAX_VRAM`` and ``MIGD_POOL_MODES``
into a config file the access point includes, and reconfigures the schedd when the
file changed. With no migd node in the collector (a collector restart, every node
down) it keeps the file as it is: an empty pool says nothing about the next node.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: What ``condor_status`` is asked: one line per slot ad of a migd node.
QUERY = [
    "condor_status",
    "-constraint",
    "MigdMaxVRAM isnt undefined",
    "-af",
    "MigdMaxVRAM",
    "MigdServes",
]


@dataclass(frozen=True)
class PoolDefaults:
    max_vram_mib: int
    modes: tuple[str, ...]

    def config_text(self) -> str:
        return (
            "# Written by `migctl pool-defaults` from the collector's migd nodes; "
            "do not edit (set MIGD_MAX_VRAM in /etc/condor/config.d instead).\n"
            f"MIGD_POOL_MAX_VRAM = {self.max_vram_mib}\n"
            f"MIGD_POOL_MODES = {','.join(self.modes)}\n"
        )

    def schedd_ad(self) -> str:
        """The SCHEDD_CRON output: published in the schedd's ad for ``condor_status -schedd``."""
        return f'MigdPoolMaxVRAM = {self.max_vram_mib}\nMigdPoolModes = "{",".join(self.modes)}"\n'


def parse_status(text: str) -> PoolDefaults | None:
    """``condor_status -af MigdMaxVRAM MigdServes`` output -> the pool's defaults (None: no
    migd node answered with a usable value)."""
    best = 0
    modes: set[str] = set()
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        try:
            best = max(best, int(fields[0]))
        except ValueError:  # "undefined" or a malformed ad: not a node to size by
            continue
        if len(fields) > 1 and fields[1] != "undefined":
            modes.update(m for m in fields[1].split(",") if m)
    return PoolDefaults(best, tuple(sorted(modes))) if best > 0 else None


def write_if_changed(path: Path, text: str) -> bool:
    """Replace ``path`` atomically when its text differs; True when it was written."""
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def run(
    write: Path | None,
    reconfig: bool,
    *,
    query: Callable[[Sequence[str]], str],
    reconfigure: Callable[[], None],
) -> int:
    text = query(QUERY)
    defaults = parse_status(text)
    if defaults is None:
        print(
            "migctl pool-defaults: no migd node in the collector; keeping the last values",
            file=sys.stderr,
        )
        return 0
    sys.stdout.write(defaults.schedd_ad())
    if write is not None and write_if_changed(write, defaults.config_text()) and reconfig:
        reconfigure()
    return 0


def main(write: Path | None, reconfig: bool) -> int:
    from migd.backends.condor import run_tool
    from migd.errors import MigdError

    def reconfigure() -> None:
        try:
            run_tool(["condor_reconfig", "-daemon", "schedd"])
        except MigdError as exc:
            print(
                f"migctl pool-defaults: {exc.message}; the new values apply at the next reconfig",
                file=sys.stderr,
            )

    try:
        return run(write, reconfig, query=run_tool, reconfigure=reconfigure)
    except MigdError as exc:
        print(f"migctl pool-defaults: {exc.message}; keeping the last values", file=sys.stderr)
        return 1
