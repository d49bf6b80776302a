"""The simulated GPU node: everything ``migd --simulate``, the demos and the tests run on.

One package holds every stand-in for the outside world, so "simulated" means one thing:

* :class:`SimNode` (``node.py``): the node's state (``state.py``), its construction,
  inspection and faults; ``node.mig`` (``mig_ops.py``): GPU and compute instances under
  the driver's placement rules; ``node.procs`` (``processes.py``): CUDA processes,
  memory and MPS servers;
* :class:`FakePynvml` (``fake_pynvml.py``): the ``pynvml`` API over a node, so the real
  :class:`~migd.backends.nvml.NvmlBackend` runs unchanged on top of it;
* :func:`simulated_backend`: both wired together;
* ``state_file`` (``persist.py``): the node's GPUs outlive the process, as real ones do;
* ``mps_control.py``: a stand-in ``nvidia-cuda-mps-control`` (run as
  ``python -m migd.backends.simulated.mps_control``); :func:`write_fake_mps_control`
  puts an executable shim of that name into a directory;
* ``cuda_job.py``: a CUDA job on the simulated GPUs (``python -m
  migd.backends.simulated.cuda_job``), what the wrapper and HTCondor tests run;
* ``accounts.py``: :class:`FakeAccounts`, the accounts port over a table;
* ``nvml_events.py``: NVML events (XIDs) over a node.

(The *policy* simulator, which replays workloads through the scheduler in simulated
time, is another thing: :mod:`migd.policysim`.)

Names are loaded on first use (PEP 562): the stand-in MPS control binary and the CUDA
job start as ``python -m`` processes many times per test run, and must neither pay for
importing the NVML backend nor find their own module already imported by this package
(runpy warns about that).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from migd.backends.simulated.accounts import FakeAccounts
    from migd.backends.simulated.backend import simulated_backend
    from migd.backends.simulated.fake_pynvml import FakePynvml
    from migd.backends.simulated.mps_control import write_fake_mps_control
    from migd.backends.simulated.node import SimNode
    from migd.backends.simulated.persist import SIM_STATE_SCHEMA
    from migd.backends.simulated.processes import SimCudaError, SimOutOfMemory
    from migd.backends.simulated.specs import SimGpuSpec, SimInstanceSpec, SimProcessSpec
    from migd.backends.simulated.state import InstanceView

#: Public name -> the module that defines it.
_HOME = {
    "FakeAccounts": "accounts",
    "simulated_backend": "backend",
    "FakePynvml": "fake_pynvml",
    "write_fake_mps_control": "mps_control",
    "SimNode": "node",
    "SIM_STATE_SCHEMA": "persist",
    "SimCudaError": "processes",
    "SimOutOfMemory": "processes",
    "SimGpuSpec": "specs",
    "SimInstanceSpec": "specs",
    "SimProcessSpec": "specs",
    "InstanceView": "state",
}


def __getattr__(name: str) -> Any:
    try:
        module = _HOME[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "SIM_STATE_SCHEMA",
    "FakeAccounts",
    "FakePynvml",
    "InstanceView",
    "SimCudaError",
    "SimGpuSpec",
    "SimInstanceSpec",
    "SimNode",
    "SimOutOfMemory",
    "SimProcessSpec",
    "simulated_backend",
    "write_fake_mps_control",
]
