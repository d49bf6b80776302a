"""The package layout's dependency rules, read from the import statements.

The core is pure logic that everything else builds on; the daemon and the job wrapper are
two programs that share the core (and the ``[wrapper]`` section model in
``migd/wrapper_section.py``) but not each other's code. Inside the daemon, only
``main()`` (``migd/daemon/main.py``) picks concrete backends; every other part gets them
through the ports (``migd/ports.py``) it is built with.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "migd"


def imported_modules(package: str, prefix: str = "migd") -> dict[str, set[str]]:
    """``{file: modules it imports}`` for every file under ``migd/<package>``, those whose
    name starts with ``prefix`` (default: migd's own; "" for all)."""
    found: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[str(path.relative_to(PACKAGE.parent))] = {n for n in names if n.startswith(prefix)}
    return found


def offenders(
    package: str, forbidden: tuple[str, ...], prefix: str = "migd"
) -> dict[str, list[str]]:
    return {
        path: sorted(
            name for name in names if any(name == f or name.startswith(f"{f}.") for f in forbidden)
        )
        for path, names in imported_modules(package, prefix).items()
        if any(name == f or name.startswith(f"{f}.") for f in forbidden for name in names)
    }


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("daemon", ("migd.wrapper", "migd.policysim")),
        ("wrapper", ("migd.daemon", "migd.policysim")),
        # The policy simulator replays workloads through the pure core alone: it never
        # starts a daemon, touches a backend or the simulated node.
        ("policysim", ("migd.daemon", "migd.wrapper", "migd.backends", "migd.cli")),
        (
            "core",
            (
                "migd.daemon",
                "migd.wrapper",
                "migd.backends",
                "migd.cli",
                "migd.policysim",
            ),
        ),
    ],
)
def test_package_does_not_import(package: str, forbidden: tuple[str, ...]) -> None:
    assert offenders(package, forbidden) == {}


def test_the_rule_sees_an_import_where_there_is_one() -> None:
    """The check itself can fail: the daemon's config does import the wrapper section."""
    config = imported_modules("daemon")["migd/daemon/config.py"]
    assert "migd.wrapper_section.WrapperSection" in config
    assert offenders("daemon", ("migd.wrapper_section",)) == {
        "migd/daemon/config.py": ["migd.wrapper_section", "migd.wrapper_section.WrapperSection"]
    }


def test_the_core_imports_no_io_library() -> None:
    """The core decides; NVML, HTCondor, processes, the state db and the event loop are
    behind the ports (``migd/ports.py``), used by the daemon."""
    io = ("pynvml", "htcondor", "psutil", "subprocess", "sqlite3", "asyncio")
    assert offenders("core", io, prefix="") == {}


#: Daemon modules besides main.py that import a backend, and why they must.
BACKEND_IMPORTS_ALLOWED = {
    # The simulator-only ops act on the simulated node itself (its fake CUDA processes,
    # its errors, its XID injection): main() registers them only when it built that node.
    "migd/daemon/api/sim_ops.py": [
        "migd.backends.simulated.node",
        "migd.backends.simulated.node.SimCudaError",
        "migd.backends.simulated.node.SimNode",
        "migd.backends.simulated.node.SimOutOfMemory",
        "migd.backends.simulated.nvml_events",
        "migd.backends.simulated.nvml_events.events_for",
    ],
}


def test_only_main_picks_concrete_backends_in_the_daemon() -> None:
    found = offenders("daemon", ("migd.backends",))
    assert "migd/daemon/main.py" in found  # the rule sees main()'s own (lazy) imports
    del found["migd/daemon/main.py"]
    assert found == BACKEND_IMPORTS_ALLOWED
