"""The package layout's dependency rules, read from the import statements.

The core is pure logic that everything else builds on; the daemon and the job wrapper are
two programs that share the core (and the ``[wrapper]`` section model in
``migd/wrapper_section.py``) but not each other's code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "migd"


def imported_modules(package: str) -> dict[str, set[str]]:
    """``{file: migd modules it imports}`` for every file under ``migd/<package>``."""
    found: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[str(path.relative_to(PACKAGE.parent))] = {n for n in names if n.startswith("migd")}
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    return {
        path: sorted(
            name for name in names if any(name == f or name.startswith(f"{f}.") for f in forbidden)
        )
        for path, names in imported_modules(package).items()
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
