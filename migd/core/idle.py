"""When MIG instances went idle, and which are idle past the policy's timeout (pure).

An instance's ``idle_since_s`` is wall time (shown to admins); the idle timeout is
measured on the monotonic clock (``idle_mono``), so a wall-clock step never tears down
an instance early or keeps one forever.
"""

from __future__ import annotations

from migd.core.gpus import ManagedGpu, ManagedInstance


def stamp_idle(gpu: ManagedGpu, now_s: float, mono_s: float) -> None:
    """Note on the monotonic clock when each instance went idle (``idle_mono``).

    The mode handlers stamp ``idle_since_s`` in wall time; a release or finished
    work is stamped here at once (exact). An instance that went idle another way
    (resync, adoption) is stamped at the next look, as ``now - idle_since_s`` ago:
    exact unless the wall clock was set in between.
    """
    for inst in gpu.instances:
        _stamp(inst, now_s, mono_s)


def _stamp(inst: ManagedInstance, now_s: float, mono_s: float) -> tuple[float, float] | None:
    """Stamp one instance (see :func:`stamp_idle`); its ``idle_mono``."""
    since = inst.idle_since_s
    if since is None:
        inst.idle_mono = None
    elif inst.idle_mono is None or inst.idle_mono[0] != since:
        inst.idle_mono = (since, mono_s - max(0.0, now_s - since))
    return inst.idle_mono


def idle_past(
    gpu: ManagedGpu, timeout_s: float, now_s: float, mono_s: float
) -> list[ManagedInstance]:
    """The instances of ``gpu`` idle for ``timeout_s`` or longer (stamped first, as
    :func:`stamp_idle` does, in the same pass: every idle timer of a pool runs this)."""
    due: list[ManagedInstance] = []
    # a timer set for idle_since + timeout must find it due, rounding or not
    limit = timeout_s - 1e-6
    for inst in gpu.instances:
        stamp = _stamp(inst, now_s, mono_s)
        if stamp is not None and mono_s - stamp[1] >= limit and not inst.busy:
            due.append(inst)
    return due


__all__ = ["idle_past", "stamp_idle"]
