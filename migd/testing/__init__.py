"""Stand-ins for the outside world, shipped with migd for tests, demos and CI without a GPU.

* :mod:`migd.testing.fake_mps_control`: a stand-in ``nvidia-cuda-mps-control``;
  :func:`write_fake_mps_control` puts an executable shim of that name into a directory.

Nothing is imported eagerly: ``python -m migd.testing.fake_mps_control`` must not find
its own module already imported by this package (runpy warns about that).
"""

from __future__ import annotations

from pathlib import Path


def write_fake_mps_control(bin_dir: Path) -> Path:
    """Create an executable ``bin_dir/nvidia-cuda-mps-control`` that runs the fake.

    See :func:`migd.testing.fake_mps_control.write_fake_mps_control`.
    """
    from migd.testing.fake_mps_control import write_fake_mps_control as write

    return write(bin_dir)


__all__ = ["write_fake_mps_control"]
