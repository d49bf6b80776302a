"""migd as an HTCondor node sees it: the daemon fixture of tests/process (a simulated node)."""

from tests.process.conftest import daemon

__all__ = ["daemon"]
