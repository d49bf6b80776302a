"""I/O adapters behind :mod:`migd.ports`: NVML (real or simulated), the process table.

Nothing here is imported by the pure core. Import the concrete modules directly
(``migd.backends.nvml``, ``migd.backends.procs``, ``migd.backends.simulated``);
this package imports none of them, so importing it never loads ``pynvml`` or ``psutil``.
"""
