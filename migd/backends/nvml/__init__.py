"""migd's NVML boundary, the only package that imports ``pynvml``: :class:`NvmlBackend`
for the daemon's GPU calls, and the event listener (:mod:`.events`).

The package's modules, each with one job:

* :mod:`.backend`: :class:`NvmlBackend`, the boundary the daemon talks to
  (:class:`migd.ports.GpuBackend`): the NVML session, the handle and MIG device caches,
  and the calls in the order the daemon needs them;
* :mod:`.errors`: NVML return codes into :mod:`migd.errors` (:func:`nvml_errors`);
* :mod:`.discovery`: one GPU's identity, MIG/persistence/compute mode and memory
  into a :class:`~migd.ports.GpuInfo`;
* :mod:`.geometry`: the GPU's MIG geometry from NVML, reconciled with the built-in table;
* :mod:`.mig`: MIG profiles and placements, compute instances, creating (the
  placement passed ``byref``) and rolling back;
* :mod:`.mig_devices`: MIG device handles and UUIDs resolved by GI/CI ids, and their cache;
* :mod:`.processes`: process listing and memory sampling on one device handle;
* :mod:`.events`: NVML's event stream (XIDs, ECC) in a thread of its own, classified
  into :class:`~migd.ports.GpuEvent`; it has its own NVML client (the module it is given).

The return-code table is :mod:`migd.backends.nvml_codes`.
"""

from migd.backends.nvml.backend import NvmlBackend
from migd.backends.nvml.errors import nvml_error_code, nvml_errors, translate_nvml_error

__all__ = ["NvmlBackend", "nvml_error_code", "nvml_errors", "translate_nvml_error"]
