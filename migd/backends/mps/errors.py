"""The MPS manager's exceptions: each says what went wrong and carries a hint.

All derive from :class:`migd.errors.MpsError`; :class:`MpsDeviceBusy` is also a
:class:`migd.errors.GpuBusy`, so the MIG teardown path retries it like any busy device.
"""

from __future__ import annotations

from migd.errors import GpuBusy, MpsError


class MpsBinaryNotFound(MpsError):
    """The control program is not installed (or not where the config says)."""

    default_hint = (
        "install the driver's MPS tools (Debian: nvidia-cuda-mps; NVIDIA packages: "
        "nvidia-compute-utils) or set the control binary path in migd.toml [mps]"
    )


class MpsCommandTimeout(MpsError):
    """A front-end command or daemon start ran past its timeout (and was killed)."""

    default_hint = (
        "the MPS control daemon did not answer in time; migd restarts it on the next "
        "health check (`migctl status` shows it)"
    )


class MpsCommandFailed(MpsError):
    """The front end found no daemon, lost the link, or the daemon rejected a command."""

    default_hint = "see the daemon's control.log (path in `migctl status`)"


class MpsDaemonStartFailed(MpsError):
    """``nvidia-cuda-mps-control -d`` failed, or the daemon never answered."""

    default_hint = (
        "see control.log in the device's MPS log directory; check that the GPU/MIG UUID "
        "exists (`nvidia-smi -L`) and that nothing else uses that pipe directory"
    )


class MpsDeviceBusy(MpsError, GpuBusy):
    """An MPS device cannot be torn down now: its server has clients, or cannot say."""

    default_hint = "migd destroys the instance once its MPS clients are gone"


class MpsServerStillRunning(MpsDeviceBusy):
    """The control daemon quit, but its server still shows as an NVML compute process."""

    default_hint = (
        "an MPS server normally exits within seconds of `quit`; see server.log in the "
        "device's MPS log directory. migd tries the teardown again later"
    )
