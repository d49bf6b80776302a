"""The simulated nvidia-cuda-mps-control shim finds migd by the path it names, not by the
interpreter's own site-packages: the Debian package runs the system python3, which knows
migd only through /usr/lib/migd (a pool job once failed with "No module named 'migd'")."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from migd.backends.simulated.mps_control import write_fake_mps_control


def test_the_shim_names_the_directory_that_holds_migd(tmp_path: Path) -> None:
    shim = write_fake_mps_control(tmp_path / "bin").read_text(encoding="utf-8")
    match = re.search(r"^PYTHONPATH=(\S+?)\$\{", shim, re.M)
    assert match, shim
    root = Path(shlex.split(match.group(1))[0])
    assert (root / "migd" / "__init__.py").is_file(), root


def test_an_isolated_interpreter_imports_the_fake_from_that_directory(tmp_path: Path) -> None:
    shim = write_fake_mps_control(tmp_path / "bin").read_text(encoding="utf-8")
    match = re.search(r"^PYTHONPATH=(\S+?)\$\{", shim, re.M)
    assert match, shim
    root = shlex.split(match.group(1))[0]
    # -S: no site-packages (no venv, no editable install), only the path the shim gives.
    proc = subprocess.run(
        [sys.executable, "-S", "-c", "import migd.backends.simulated.mps_control"],
        env={"PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
