"""``migd --check-config`` names the file it read (not "defaults" when it read one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _check(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "migd", "--check-config", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return result.stdout.strip()


def test_check_config_names_the_file_it_read(tmp_path: Path) -> None:
    config = tmp_path / "migd.toml"
    config.write_text("version = 1\n[policy]\nqueue = 'fifo'\n")
    assert _check("--config", str(config)) == f"configuration OK ({config})"


def test_check_config_without_a_file_says_which_one_is_missing() -> None:
    out = _check()
    # /etc/migd/migd.toml on this host may or may not exist; either way the path is named
    assert out.startswith("configuration OK (") and "/etc/migd/migd.toml" in out
    if not Path("/etc/migd/migd.toml").exists():
        assert out == "configuration OK (defaults, no /etc/migd/migd.toml)"
