"""How fast MPS clients run when they share a device (pure; calibrated to [Voigtlaender]).

One model for every MPS device the simulator knows: a whole GPU in MPS mode and an
MPS server inside a MIG instance ([Voigtlaender] §3: "both MIG and MPS can be used
together"). A device offers ``capacity`` of a whole GPU's compute (1 for a GPU, ``c/C``
for an instance of ``c`` of ``C`` compute slices). Its ``n`` clients keep ``d_i`` of a
whole GPU busy each (:attr:`migd.policysim.jobs.WorkloadJob.compute_demand`), ``D = sum d_i``.
Client ``i`` gets the share

    share_i = d_i * min(1, capacity / D) / (contention * overload)

* **processor sharing** ``min(1, capacity / D)``: clients run concurrently (MPS fuses
  their contexts, no time slicing) until together they ask for more than the device
  has; then every client slows by the same factor. This is how busy they are.
* **contention** ``1 + kappa * (n - 1) * min(1, D / capacity)``: extra slowdown per
  co-running client, scaled by how busy the device is (shared L2, memory bandwidth).
* **overload** ``max(1, n / server_clients)``: one server manages at most 48 client
  contexts per device (NVIDIA MPS documentation, "Limitations"); [Voigtlaender] §3.1
  saw slowdown start "around 50 processes managed by one server".

A client then runs ``runtime * max(1, d_i / share_i)`` (:func:`migd.policysim.jobs.runtime_at`).

**Calibration** (:func:`fit_kit`, the numbers in ``docs/simulator.md``). [Voigtlaender]
publishes, for its small TensorFlow training on an A100-40GB:

* Table 1 (bare metal, 12 per GPU): 10.56 min alone, 16.23 min with MPS: slowdown 1.537
  at ``n = 12``;
* Table 2 (HTCondor, 12 slots per GPU with MPS, 7 with MIG, 1 by default): 18.16,
  14.14 and 1.94 epochs/s. The paper reads the difference as slots ("the throughput
  for an individual job is nearly equal between all setups except simple sharing"),
  so 12 slots at 9.36x is a per-job slowdown of 12 / 9.36 = 1.282 at ``n = 12``, and 7
  MIG slots at 7.29x say a ``1g`` instance does not slow the job (``7 d <= 1``);
* Figure 2 (bare metal, 1-12 copies): with MPS "the runtime shows little to no
  increase", and twelve copies give "close to a factor of five" more throughput than
  without MPS (the conclusion: "compared to the non MPS scenario"), where runtime grows
  close to linearly.

Every MPS point is at ``n = 12``, so they fix only the slowdown ``s12`` there: the
least-squares fit in log space of Table 1 and Table 2 is ``s12 = sqrt(1.537 * 1.282)
= 1.404`` (residuals: -8.6 % on Table 1's runtime, -8.7 % on Table 2's ratio). How
``s12`` splits into demand ``d`` and contention ``kappa`` is decided by Figure 2's
shape: ``kappa > 0`` raises the runtime from the second client on, and the figure
shows little to no increase, so the fit takes ``kappa = 0`` and ``d = s12 / 12 =
0.117`` (runtime flat up to 8 clients, then growing to 1.40x at 12). ``kappa`` stays
a parameter for other calibrations and sensitivity runs; ``d`` is the KIT job's, set in
:func:`migd.policysim.workloads.kit_mix`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from migd.errors import InvalidRequest

#: Client contexts one MPS server manages per device (NVIDIA MPS docs; [Voigtlaender] §3.1).
MPS_SERVER_CLIENTS = 48


@dataclass(frozen=True)
class MpsInterference:
    """The MPS sharing model (module docstring).

    Attributes:
        kappa: contention per co-running client at a fully busy device (fitted: 0).
        server_clients: clients one server manages before every client slows down.
        flat: an extra slowdown of every client while two or more share (the older
            ``--mps-interference`` knob; 0 in the calibrated model).
    """

    kappa: float = 0.0
    server_clients: int = MPS_SERVER_CLIENTS
    flat: float = 0.0

    def __post_init__(self) -> None:
        if self.kappa < 0 or self.flat < 0:
            raise InvalidRequest("MPS contention and interference must not be negative")
        if self.server_clients < 1:
            raise InvalidRequest("server_clients must be at least 1")

    def shares(self, demands: Sequence[float], capacity: float = 1.0) -> list[float]:
        """Each client's share of a whole GPU on a device of ``capacity`` (0, 1]."""
        n = len(demands)
        if n == 0:
            return []
        if not 0 < capacity <= 1:
            raise ValueError("capacity must be in (0, 1]")
        total = sum(demands)
        busy = min(1.0, total / capacity)
        scale = min(1.0, capacity / total) if total > 0 else 1.0
        contention = 1.0 + self.kappa * (n - 1) * busy
        overload = max(1.0, n / self.server_clients)
        flat = 1.0 + (self.flat if n > 1 else 0.0)
        return [d * scale / (contention * overload * flat) for d in demands]

    def slowdown(self, n: int, demand: float, capacity: float = 1.0) -> float:
        """Runtime multiplier of ``n`` identical clients of ``demand`` each."""
        share = self.shares([demand] * n, capacity)[0]
        return max(1.0, demand / share)


@dataclass(frozen=True)
class Observation:
    """One published figure the model is fitted to or checked against."""

    source: str
    what: str
    value: float
    predicted: float = math.nan
    fitted: bool = True

    @property
    def residual(self) -> float:
        """Relative error of the prediction (+: the model says more)."""
        return self.predicted / self.value - 1.0


@dataclass(frozen=True)
class KitFit:
    """The fitted KIT job and model, with every published figure next to its prediction."""

    demand: float
    model: MpsInterference
    observations: tuple[Observation, ...]


#: [Voigtlaender] Table 1 (minutes) and Table 2 (epochs/s), A100-40GB.
T1_DEFAULT_MIN = 10.56
T1_MPS_MIN = 16.23
T1_MIG_MIN = 9.41
T2_DEFAULT, T2_SIMPLE, T2_MPS, T2_MIG = 1.94, 10.06, 18.16, 14.14
KIT_MPS_SLOTS, KIT_MIG_SLOTS = 12, 7


def fit_kit(kappa: float = 0.0) -> KitFit:
    """Fit the KIT job's demand to [Voigtlaender] (module docstring), for a given ``kappa``.

    ``kappa = 0`` is the calibrated model; other values give the demand that keeps the
    fitted 12-client slowdown, for sensitivity runs.
    """
    t1 = T1_MPS_MIN / T1_DEFAULT_MIN
    t2 = KIT_MPS_SLOTS / (T2_MPS / T2_DEFAULT)
    s12 = math.sqrt(t1 * t2)  # log least squares of two points
    model = MpsInterference(kappa=kappa)
    # s(12) = 12 d (1 + 11 kappa) once 12 d >= 1: solve for d, bisect (monotone in d)
    lo, hi = 1e-4, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if model.slowdown(KIT_MPS_SLOTS, mid) < s12:
            lo = mid
        else:
            hi = mid
    d = round((lo + hi) / 2, 4)
    s = model.slowdown(KIT_MPS_SLOTS, d)
    mig = max(1.0, KIT_MIG_SLOTS * d)  # a 1g instance: share 1/7
    obs = (
        Observation("Table 1", "runtime with 12 MPS clients / alone", t1, s),
        Observation("Table 2", "MPS / default throughput (12 slots)", T2_MPS / T2_DEFAULT, 12 / s),
        Observation(
            "Table 2",
            "MIG / default throughput (7 slots)",
            T2_MIG / T2_DEFAULT,
            KIT_MIG_SLOTS / mig,
            fitted=False,
        ),
        Observation(
            "Table 1", "runtime on 1g.5gb / alone", T1_MIG_MIN / T1_DEFAULT_MIN, mig, fitted=False
        ),
        Observation(
            "Figure 2",
            "12 MPS copies: throughput / one copy (brief's reading of 'close to five')",
            5.0,
            12 / s,
            fitted=False,
        ),
        Observation(
            "Figure 2",
            "runtime with 6 MPS copies / alone ('little to no increase')",
            1.0,
            model.slowdown(6, d),
            fitted=False,
        ),
    )
    return KitFit(d, model, obs)


#: The calibrated model every simulation uses unless told otherwise.
CALIBRATED = MpsInterference()

__all__ = [
    "CALIBRATED",
    "MPS_SERVER_CLIENTS",
    "KitFit",
    "MpsInterference",
    "Observation",
    "fit_kit",
]
