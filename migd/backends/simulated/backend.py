"""``simulated_backend``: the real NVML backend over a simulated node."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from migd.backends.nvml import NvmlBackend
from migd.backends.simulated.fake_pynvml import FakePynvml
from migd.backends.simulated.node import SimNode

_BACKEND_OPTIONS = ("destroy_retries", "retry_backoff_s", "sleep")


def simulated_backend(
    description: str | Path | SimNode, **options: Any
) -> tuple[NvmlBackend, SimNode]:
    """An :class:`NvmlBackend` over a simulated node, and the node (to inspect or disturb).

    Args:
        description: ``"8xA100-40GB"``, a mixed list, TOML text or file, a probe JSON
            file (see :mod:`migd.backends.simulated.specs`), or a ready :class:`SimNode`.
        **options: ``destroy_retries``, ``retry_backoff_s`` and ``sleep`` go to the
            backend; the rest (``seed``, ``time_scale``, ``root``, ``state_file``, ...)
            to the node. ``state_file`` (``backend.sim_state_file``) keeps the GPUs'
            state in that file across restarts (see :class:`SimNode`).

    Raises:
        ConfigError: the description is malformed, or the state file is corrupt or
            was written for other GPUs (``where="backend.sim_state_file"``).
        StateStoreError: the state file cannot be written.
    """
    backend_options = {k: options.pop(k) for k in _BACKEND_OPTIONS if k in options}
    if isinstance(description, SimNode):
        if options:
            raise TypeError(f"node options {sorted(options)} given with a ready SimNode")
        node = description
    elif isinstance(description, Path) and description.suffix == ".json":
        node = SimNode.from_probe(description, **options)
    else:
        node = SimNode.from_description(description, **options)
    sleep: Callable[[float], None] | None = backend_options.pop("sleep", None)
    if sleep is not None:
        return NvmlBackend(FakePynvml(node), sleep=sleep, **backend_options), node
    return NvmlBackend(FakePynvml(node), **backend_options), node
