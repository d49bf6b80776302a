"""Memory-growth forecast: will a running job outgrow its partition before it ends?

[MIG-HT] (§3.2.3) restarts a job on a bigger partition *before* it runs out of GPU
memory: it fits a least-squares line to the memory series sampled once per
iteration, puts a 99% band on the extrapolation from the residual spread, and
fires when the band at the last iteration exceeds the partition. This module is
that forecaster, pure (no I/O, no numpy: the series are short and plain ``math``
is enough), fed by the job wrapper one :class:`MemorySample` at a time.

**Which series** ([MIG-HT] §3.2.1). What causes an out-of-memory error is the
memory the program actually holds, *PyTorch allocated + CUDA context*; PyTorch
*reserved* memory is a cache the allocator empties and retries with before it
raises, so it does not by itself cause OOM. What NVML sees (``used``) is reserved
+ context: an upper bound that ratchets up with the cache. So the forecaster
uses, in order of preference (``ForecastPolicy.series = "auto"``):

``reuse``
    the paper's own method, when the job reports allocator request statistics:
    the memory *requested* from the caching allocator per step and its reuse
    ratio (see below), each fitted linearly, combined into physical memory,
    plus the context;
``allocated``
    the job's per-step peak ``torch.cuda.max_memory_allocated()`` fitted
    linearly, plus the context;
``used``
    NVML's used memory of the job (reserved + context), when the job reports
    nothing. Sampled per time step if there are no iterations. Meaningless for
    frameworks that pre-allocate (TensorFlow, JAX): run those with
    ``TF_FORCE_GPU_ALLOW_GROWTH=true`` / ``XLA_PYTHON_CLIENT_PREALLOCATE=false``.

The constant context is ``median(used - reserved)`` over the samples that carry
both, or ``ForecastPolicy.context_mib`` when set (0 when neither is known).

**The reuse ratio, as we read [MIG-HT].** The paper defines the reuse ratio so
that "a lower reuse ratio indicates more reuse, meaning that the actual
physical memory needed is smaller relative to the total requested memory", and
observes that it falls over time. That makes it ``physical / requested``; the
*inverse reuse ratio* ``q = requested / physical`` grows, roughly linearly, and
is what the paper fits a line to. The combination (the equation is lost from our
copy of the paper) is therefore ``physical(x) = requested(x) / q(x)``. A job
reports ``requested_mib`` (per step: the growth of PyTorch's cumulative
``requested_bytes.all.allocated`` counter over the step) and either
``reuse_ratio`` (``physical / requested``) or ``allocated_mib`` (the step's
peak, from which ``q = requested / allocated``). Because ``physical <=
requested`` by construction, ``q`` is floored at 1 when every observed ``q`` is.
Whatever definition of "requested" a job uses (per step or cumulative), the
formula holds as long as the ratio refers to the same quantity.

**The band.** For a new observation at step ``x0`` of a fitted line the
prediction interval is ``yhat(x0) ± k · s · sqrt(1 + 1/n + (x0 - xbar)² / Sxx)``
with ``s² = SSE / (n - 2)``. The paper's ``yhat + z·σ`` keeps only the ``1``
under the root, i.e. it ignores that the line itself is uncertain. Early in a run
(n ≈ 6) extrapolated to the end (x0 ≈ 100) the leverage term
``(x0 - xbar)² / Sxx`` is about 500, so the paper's band is some 20 times too
narrow exactly when the decision is made; we keep the full term
(``ForecastPolicy.leverage``, on by default). For the reuse model the two
fits' prediction variances are combined with the delta method
(``Var(R/q) ≈ Var(R)/q² + R²·Var(q)/q⁴``, independent residuals assumed; the
paper does not say how it combines them).

**The multiplier** ``k``: OOM is a one-sided risk (only exceeding the
partition hurts), so the default is the one-sided 99% quantile, ``z = 2.326``:
"at most a 1% chance that memory at the horizon exceeds the bound". The paper
says "99% confidence interval", which usually means the two-sided 2.576; that
is a one-sided 99.5% bound, reachable with ``one_sided=False`` or ``z=2.576``.
Because ``s`` is estimated from few residuals the exact quantile is Student's
``t`` with ``n - 2`` degrees of freedom (``student_t``, on by default): with 6
samples it is 3.75, not 2.33. A wider band fires *earlier* (the upper bound
crosses the limit sooner), so both choices lean towards restarting early; the
minimum-sample and convergence gates are what protect against restarting a job
that would have fitted.

**The decision** (:meth:`Forecaster.verdict`): fire when the upper bound of the
prediction between now and the job's horizon (its total iterations, or a time
horizon; without one, as far ahead as already observed) exceeds the partition
limit minus a safety margin, once at least ``min_samples`` were seen and the
forecast has settled: the point forecasts of the peak made after each of the
last ``convergence_window`` samples agree within ``convergence_rel_tol`` (or
``convergence_abs_mib``) -- *or* all of them exceed the threshold. The second
clause matters for convex growth (quadratic attention memory): there every new
sample raises the forecast, so it never agrees with itself, and a gate on
agreement alone let such jobs run into the OOM (``bench/results/forecast.md``).
:attr:`Forecast.needed_mib` is the smallest partition
on which the same prediction would *not* fire, so the wrapper can pass it to
:func:`migd.core.planner.next_larger` as ``peak_mib``.

The predicted peak is for one new observation at the horizon; the maximum over
all remaining steps is slightly higher when the residuals are independent noise.
The safety margin absorbs that and allocator fragmentation.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from migd.errors import ConfigError

Series = Literal["reuse", "allocated", "used"]
SeriesChoice = Literal["auto", "reuse", "allocated", "used"]

_GRID_INTERVALS = 32  # evaluation points between now and the horizon (exact for lines)
# Readings beyond these are garbage, not memory: no device has a petabyte, and no run
# has more than 1e15 steps (epoch milliseconds are 1.7e12). Keeping values finite and
# bounded keeps every sum below float overflow.
MAX_MIB = 1e9
MAX_STEP = 1e15


# -- statistics -----------------------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function ``I_x(a, b)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@lru_cache(maxsize=512)
def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``0 < p < 1``).

    Bisection on the CDF; beyond a million degrees of freedom the normal quantile.
    """
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"need 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    if df > 1e6:
        return statistics.NormalDist().inv_cdf(p)
    hi = 1.0
    while student_t_cdf(hi, df) < p:
        hi *= 2.0
    lo = 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True, slots=True)
class LineFit:
    """A least-squares line through ``n`` points, kept as centred moments.

    Steps are stored relative to the first one (``origin``), and ``sxx``, ``sxy``,
    ``syy`` (sums of centred squares and products) are updated one point at a time
    (Welford). Both keep the fit exact when the steps are epoch seconds and the values
    tens of thousands of MiB, where the textbook ``Σx² - n·x̄²`` loses every digit.
    """

    n: int = 0
    origin: float = 0.0
    mean_dx: float = 0.0
    mean_y: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, x: float, y: float) -> LineFit:
        origin = x if self.n == 0 else self.origin
        n = self.n + 1
        x_rel = x - origin
        dx = x_rel - self.mean_dx
        dy = y - self.mean_y
        mean_dx = self.mean_dx + dx / n
        mean_y = self.mean_y + dy / n
        return LineFit(
            n,
            origin,
            mean_dx,
            mean_y,
            self.sxx + dx * (x_rel - mean_dx),
            self.sxy + dx * (y - mean_y),
            self.syy + dy * (y - mean_y),
        )

    @property
    def slope(self) -> float:
        """Units of y per step; 0 with fewer than two distinct steps."""
        return self.sxy / self.sxx if self.n >= 2 and self.sxx > 0 else 0.0

    @property
    def intercept(self) -> float:
        """The line's value at step 0 (of the caller's step coordinates)."""
        return self.predict(0.0)

    @property
    def df(self) -> int:
        """Residual degrees of freedom (``n - 2``)."""
        return max(0, self.n - 2)

    @property
    def sse(self) -> float:
        """Sum of squared residuals."""
        if self.n < 2 or self.sxx <= 0:
            return max(0.0, self.syy)
        return max(0.0, self.syy - self.sxy * self.sxy / self.sxx)

    @property
    def sigma(self) -> float:
        """Residual standard deviation ``sqrt(SSE / (n - 2))``; 0 below three points."""
        return math.sqrt(self.sse / self.df) if self.df > 0 else 0.0

    def predict(self, x: float) -> float:
        return self.mean_y + self.slope * ((x - self.origin) - self.mean_dx)

    def prediction_se(self, x: float, *, leverage: bool = True) -> float:
        """Standard error of a *new observation* at ``x`` (not of the mean line).

        With ``leverage`` the textbook ``s·sqrt(1 + 1/n + (x - x̄)²/Sxx)``; without, the
        paper's plain residual ``s``.
        """
        s = self.sigma
        if not leverage or self.n < 2 or self.sxx <= 0:
            return s
        distance = (x - self.origin) - self.mean_dx
        return s * math.sqrt(1.0 + 1.0 / self.n + distance * distance / self.sxx)


# -- policy and samples ---------------------------------------------------------------------


@dataclass(frozen=True)
class ForecastPolicy:
    """Thresholds of the forecast; the defaults are argued in the module docstring.

    Attributes:
        confidence: coverage of the band (0.99: [MIG-HT]'s 99%).
        one_sided: ``True``: the upper ``confidence`` quantile (z = 2.326 for 99%);
            ``False``: the upper end of a two-sided interval (z = 2.576 for 99%).
        z: a fixed multiplier instead of the quantile (e.g. 2.576 to copy the paper).
        student_t: use Student's t with ``n - 2`` degrees of freedom instead of the
            normal quantile (ignored when ``z`` is given).
        leverage: include the extrapolation (leverage) term of the prediction interval.
        min_samples: samples before any decision (at least 3: two for a line, one
            for the residual spread).
        convergence_window: the last this-many fits must agree for the fit to count
            as converged (1 disables the check).
        convergence_rel_tol / convergence_abs_mib: how close they must agree: their
            spread at most ``max(rel_tol × forecast, abs_mib)``. The gate, not the
            band, is what keeps a noisy job that fits from being restarted: on the
            synthetic seed-002 traces (``bench/results/forecast.md``) window 3 / 5%
            restarted 5 of 80 jobs that fit, window 4 / 3% none, at the cost of
            firing one to three iterations later (still ~65-90 before the LLM OOMs).
        safety_margin_mib / safety_margin_frac: fire when the upper bound passes
            ``limit - max(margin_mib, margin_frac × limit)`` (fragmentation, and the
            peak being the maximum of many steps rather than one).
        lookahead_factor: without a horizon, look ahead ``factor ×`` the span observed.
        warmup_steps: ignore samples within this many steps of the first one
            (model loading, allocator warm-up; useful for time-based sampling).
        series: ``"auto"`` (reuse > allocated > used, whichever has ``min_samples``)
            or one of them.
        context_mib: the constant CUDA context and miscellaneous memory added to the
            allocator series; ``None`` estimates it as ``median(used - reserved)``.
    """

    confidence: float = 0.99
    one_sided: bool = True
    z: float | None = None
    student_t: bool = True
    leverage: bool = True
    min_samples: int = 5
    convergence_window: int = 4
    convergence_rel_tol: float = 0.03
    convergence_abs_mib: float = 128.0
    safety_margin_mib: float = 256.0
    safety_margin_frac: float = 0.03
    lookahead_factor: float = 1.0
    warmup_steps: float = 0.0
    series: SeriesChoice = "auto"
    context_mib: float | None = None

    def __post_init__(self) -> None:
        def bad(where: str, what: str) -> ConfigError:
            return ConfigError(what, where=f"forecast.{where}")

        if not 0.5 < self.confidence < 1.0:
            raise bad("confidence", f"must be between 0.5 and 1, got {self.confidence}")
        if self.z is not None and not (math.isfinite(self.z) and self.z >= 0):
            raise bad("z", f"must be a finite non-negative number, got {self.z}")
        if self.min_samples < 3:
            raise bad("min_samples", f"must be at least 3, got {self.min_samples}")
        if self.convergence_window < 1:
            raise bad("convergence_window", f"must be at least 1, got {self.convergence_window}")
        for name in (
            "convergence_rel_tol",
            "convergence_abs_mib",
            "safety_margin_mib",
            "lookahead_factor",
            "warmup_steps",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise bad(name, f"must be a finite non-negative number, got {value}")
        if not 0.0 <= self.safety_margin_frac < 1.0:
            raise bad("safety_margin_frac", f"must be in [0, 1), got {self.safety_margin_frac}")
        if self.series not in ("auto", "reuse", "allocated", "used"):
            raise bad("series", f"must be auto, reuse, allocated or used, got {self.series!r}")
        if self.context_mib is not None and not (
            math.isfinite(self.context_mib) and self.context_mib >= 0
        ):
            raise bad("context_mib", f"must be a non-negative number, got {self.context_mib}")

    def multiplier(self, df: int) -> float:
        """The band multiplier ``k`` for a fit with ``df`` residual degrees of freedom."""
        if self.z is not None:
            return self.z
        p = self.confidence if self.one_sided else 0.5 + self.confidence / 2.0
        if self.student_t and df >= 1:
            return student_t_quantile(p, float(df))
        return statistics.NormalDist().inv_cdf(p)

    def margin_mib(self, limit_mib: float) -> float:
        return max(self.safety_margin_mib, self.safety_margin_frac * limit_mib)

    def needed_mib(self, upper_mib: float) -> int:
        """The smallest limit whose threshold is at least ``upper_mib`` (inverse of the rule).

        Capped at :data:`MAX_MIB` (also for a non-finite bound): more than any partition.
        """
        if not upper_mib < MAX_MIB:  # also NaN and inf
            return int(MAX_MIB)
        upper = max(0.0, upper_mib)
        need = max(upper + self.safety_margin_mib, upper / (1.0 - self.safety_margin_frac))
        return min(int(MAX_MIB), math.ceil(need - 1e-9))


@dataclass(frozen=True, slots=True)
class MemorySample:
    """What the wrapper knows about the job's GPU memory at one step, in MiB.

    Attributes:
        step: the iteration index (or seconds since start when the job reports no
            iterations); must increase from sample to sample.
        used_mib: what NVML sees for the job (reserved + context), as
            ``nvidia-smi --query-compute-apps=pid,used_memory`` shows.
        allocated_mib: the step's peak ``torch.cuda.max_memory_allocated()`` (reset
            with ``torch.cuda.reset_peak_memory_stats()`` at each step).
        reserved_mib: ``torch.cuda.memory_reserved()``; with ``used_mib`` it yields the
            context estimate.
        requested_mib: memory requested from the caching allocator during the step
            (the growth of ``torch.cuda.memory_stats()["requested_bytes.all.allocated"]``).
        reuse_ratio: ``physical / requested`` for the step ([MIG-HT]'s reuse ratio).

    Missing, NaN, infinite or negative values count as "not reported".
    """

    step: float
    used_mib: float | None = None
    allocated_mib: float | None = None
    reserved_mib: float | None = None
    requested_mib: float | None = None
    reuse_ratio: float | None = None


# -- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Forecast:
    """The prediction, independent of any partition limit.

    ``predicted_peak_mib`` is the point forecast of the peak between the first sample
    and the horizon (never below the peak already observed), ``upper_mib`` its upper
    band, ``at_step`` where the upper band is highest. ``slope``/``intercept``/``sigma``
    describe the fitted series (the requested memory for the reuse model, whose
    inverse-ratio line is in ``ratio_slope``/``ratio_intercept``). ``needed_mib`` is the
    smallest partition on which this prediction would not fire. ``recent_peaks_mib``
    are the point forecasts made after each of the last ``convergence_window`` samples
    (oldest first), ``spread_mib`` their range and ``converged`` whether it is within
    the tolerance.
    """

    series: Series | None
    n: int
    horizon_step: float
    predicted_peak_mib: float
    upper_mib: float
    at_step: float
    observed_peak_mib: float
    slope: float
    intercept: float
    sigma: float
    multiplier: float
    context_mib: float
    converged: bool
    spread_mib: float
    needed_mib: int
    note: str = ""
    recent_peaks_mib: tuple[float, ...] = ()
    ratio_slope: float | None = None
    ratio_intercept: float | None = None


@dataclass(frozen=True)
class Verdict:
    """Whether to restart the job on a bigger partition now, and why.

    Attributes:
        fire: restart now.
        predicted_peak_mib: point forecast of the job's peak up to the horizon.
        upper_mib: its upper band (the number compared with the limit).
        at_step: the step of that upper bound (normally the horizon).
        slope, intercept, sigma: the fitted line (MiB/step, MiB at step 0, MiB).
        n: samples in the fit.
        reason: one line for logs and ``migctl explain``.
        series: ``reuse``, ``allocated`` or ``used`` (``None`` before any sample).
        limit_mib, threshold_mib: the partition and ``limit - margin``.
        horizon_step: the step the forecast looks ahead to.
        converged: the convergence gate passed.
        crossing_step: first step at which the upper band passes the threshold.
        needed_mib: smallest partition on which this prediction would not fire.
    """

    fire: bool
    predicted_peak_mib: float
    upper_mib: float
    at_step: float
    slope: float
    intercept: float
    sigma: float
    n: int
    reason: str
    series: Series | None = None
    limit_mib: float = 0.0
    threshold_mib: float = 0.0
    horizon_step: float = 0.0
    converged: bool = False
    crossing_step: float | None = None
    needed_mib: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (MiB rounded to 0.1) for the daemon API and logs."""

        def r(value: float | None) -> float | None:
            return None if value is None else round(value, 1)

        return {
            "fire": self.fire,
            "series": self.series,
            "n": self.n,
            "predicted_peak_mib": r(self.predicted_peak_mib),
            "upper_mib": r(self.upper_mib),
            "needed_mib": self.needed_mib,
            "limit_mib": r(self.limit_mib),
            "threshold_mib": r(self.threshold_mib),
            "at_step": r(self.at_step),
            "horizon_step": r(self.horizon_step),
            "crossing_step": r(self.crossing_step),
            "slope_mib_per_step": round(self.slope, 4),
            "intercept_mib": r(self.intercept),
            "sigma_mib": r(self.sigma),
            "converged": self.converged,
            "reason": self.reason,
        }


# -- the forecaster -------------------------------------------------------------------------


def _clean(value: float | None, *, positive: bool = False) -> float | None:
    """A usable reading, or ``None`` for missing, non-numeric, NaN, negative or absurd."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    if not 0 <= value <= MAX_MIB or (positive and value == 0):
        return None  # NaN fails the comparison too
    return value


class _Track:
    """One fitted series with the fits after each of its last few samples."""

    __slots__ = ("fit", "history", "peak", "peak_step")

    def __init__(self, window: int) -> None:
        self.fit = LineFit()
        self.history: deque[LineFit] = deque(maxlen=window)
        self.peak = -math.inf
        self.peak_step = 0.0

    def add(self, x: float, y: float, physical: float | None = None) -> None:
        self.fit = self.fit.add(x, y)
        self.history.append(self.fit)
        value = y if physical is None else physical
        if value > self.peak:
            self.peak, self.peak_step = value, x


@dataclass(frozen=True, slots=True)
class _Curve:
    """A fitted memory curve: point forecast and standard error of a new observation."""

    fit: LineFit
    ratio: LineFit | None  # the inverse reuse ratio (reuse model only)
    ratio_floor: float
    offset: float
    leverage: bool

    @property
    def df(self) -> int:
        return self.fit.df if self.ratio is None else min(self.fit.df, self.ratio.df)

    def at(self, x: float) -> tuple[float, float]:
        requested = self.fit.predict(x)
        se_requested = self.fit.prediction_se(x, leverage=self.leverage)
        if self.ratio is None:
            return requested + self.offset, se_requested
        q = max(self.ratio.predict(x), self.ratio_floor)
        se_q = self.ratio.prediction_se(x, leverage=self.leverage)
        physical = requested / q
        se = math.sqrt((se_requested / q) ** 2 + (requested * se_q / (q * q)) ** 2)
        return physical + self.offset, se


class Forecaster:
    """Collects one job's memory samples and forecasts its peak ([MIG-HT] §3.2.3).

    One instance per job run; the wrapper calls :meth:`observe` once per iteration
    (or sampling interval) and :meth:`verdict` whenever it wants a decision. Nothing
    here raises on bad data: unusable samples are counted in :attr:`rejected` and
    the verdict's ``reason`` says why it cannot decide yet.

    Example::

        fc = Forecaster()
        for it in range(n_iters):
            ...
            fc.observe(MemorySample(it, used_mib=nvml_used, allocated_mib=peak_alloc))
            v = fc.verdict(limit_mib=9984, horizon=n_iters - 1)
            if v.fire:
                restart_on(next_larger(profiles, current, peak_mib=v.needed_mib))
    """

    def __init__(self, policy: ForecastPolicy | None = None) -> None:
        self.policy = policy or ForecastPolicy()
        window = self.policy.convergence_window
        self._used = _Track(window)
        self._allocated = _Track(window)
        self._requested = _Track(window)
        self._ratio = _Track(window)
        self._ratio_min = math.inf
        self._context: deque[float] = deque(maxlen=256)
        self._first_step: float | None = None
        self._last_step: float | None = None
        self.accepted = 0
        self.rejected: dict[str, int] = {}

    # -- input ----------------------------------------------------------------------------

    def _reject(self, why: str) -> bool:
        self.rejected[why] = self.rejected.get(why, 0) + 1
        return False

    def observe(self, sample: MemorySample) -> bool:
        """Add one sample; ``False`` (and a count in :attr:`rejected`) if unusable.

        Unusable: a step that is not a finite number or does not increase, a sample
        within the warm-up, or one that carries no valid memory figure.
        """
        step = sample.step
        if isinstance(step, bool) or not isinstance(step, int | float):
            return self._reject("bad_step")
        x = float(step)
        if not abs(x) <= MAX_STEP:  # also NaN
            return self._reject("bad_step")
        if self._last_step is not None and x <= self._last_step:
            return self._reject("step_not_increasing")
        if self._first_step is None:
            self._first_step = x
        if x < self._first_step + self.policy.warmup_steps:
            self._last_step = x
            return self._reject("warmup")

        used = _clean(sample.used_mib)
        allocated = _clean(sample.allocated_mib)
        reserved = _clean(sample.reserved_mib)
        requested = _clean(sample.requested_mib, positive=True)
        ratio = _clean(sample.reuse_ratio, positive=True)
        inverse: float | None = None
        if requested is not None:
            if ratio is not None:
                inverse = 1.0 / ratio
            elif allocated is not None and allocated > 0:
                inverse = requested / allocated
            if inverse is not None and not 1e-6 <= inverse <= 1e6:
                inverse = None  # a reuse ratio beyond a million either way is not one
        if used is None and allocated is None and inverse is None:
            return self._reject("no_memory_figure")

        self._last_step = x
        self.accepted += 1
        if used is not None:
            self._used.add(x, used)
            if reserved is not None and used >= reserved:
                self._context.append(used - reserved)
        if allocated is not None:
            self._allocated.add(x, allocated)
        if requested is not None and inverse is not None:
            self._requested.add(x, requested, physical=requested / inverse)
            self._ratio.add(x, inverse)
            self._ratio_min = min(self._ratio_min, inverse)
        return True

    def add(
        self,
        step: float,
        *,
        used_mib: float | None = None,
        allocated_mib: float | None = None,
        reserved_mib: float | None = None,
        requested_mib: float | None = None,
        reuse_ratio: float | None = None,
    ) -> bool:
        """Shorthand for ``observe(MemorySample(step, ...))``."""
        return self.observe(
            MemorySample(step, used_mib, allocated_mib, reserved_mib, requested_mib, reuse_ratio)
        )

    @property
    def last_step(self) -> float | None:
        return self._last_step

    @property
    def context_mib(self) -> float:
        """The constant context memory added to the allocator series."""
        if self.policy.context_mib is not None:
            return self.policy.context_mib
        return statistics.median(self._context) if self._context else 0.0

    # -- model selection ------------------------------------------------------------------

    def _series(self) -> Series | None:
        counts: dict[Series, int] = {
            "reuse": self._requested.fit.n,
            "allocated": self._allocated.fit.n,
            "used": self._used.fit.n,
        }
        choice = self.policy.series
        if choice != "auto":
            return choice
        for name in ("reuse", "allocated", "used"):
            if counts[name] >= self.policy.min_samples:
                return name
        best = max(counts, key=lambda k: counts[k])
        return best if counts[best] > 0 else None

    def _curves(self, series: Series) -> tuple[list[_Curve], float, float]:
        """The curves after each of the last few samples (oldest first), observed peak."""
        leverage = self.policy.leverage
        if series == "used":
            track = self._used
            curves = [_Curve(f, None, 0.0, 0.0, leverage) for f in track.history]
            return curves, track.peak, track.peak_step
        context = self.context_mib
        if series == "allocated":
            track = self._allocated
            curves = [_Curve(f, None, 0.0, context, leverage) for f in track.history]
            return curves, track.peak + context, track.peak_step
        floor = 1.0 if self._ratio_min >= 1.0 else 1e-6
        curves = [
            _Curve(r, q, floor, context, leverage)
            for r, q in zip(self._requested.history, self._ratio.history, strict=True)
        ]
        return curves, self._requested.peak + context, self._requested.peak_step

    # -- output ---------------------------------------------------------------------------

    def _horizon(self, horizon: float | None) -> tuple[float, str]:
        last = self._last_step if self._last_step is not None else 0.0
        first = self._first_step if self._first_step is not None else last
        if isinstance(horizon, int | float) and not isinstance(horizon, bool):
            h = float(horizon)
            if last <= h <= MAX_STEP:
                return h, ""
            note = "horizon already passed or invalid; "
        else:
            note = ""
        return last + self.policy.lookahead_factor * (last - first), note + "no horizon: " + (
            f"looking {self.policy.lookahead_factor:g}x the observed span ahead"
        )

    def forecast(self, horizon: float | None = None) -> Forecast:
        """Forecast the peak up to ``horizon`` (a step, e.g. the last iteration's index).

        ``None`` (or a horizon already passed) looks ``lookahead_factor ×`` the observed
        span ahead.
        """
        return self._forecast(horizon)[0]

    def _forecast(self, horizon: float | None) -> tuple[Forecast, _Curve | None]:
        h, note = self._horizon(horizon)
        series = self._series()
        policy = self.policy
        curves, observed, observed_step = self._curves(series) if series else ([], 0.0, h)
        if not curves:
            empty = Forecast(
                series=series,
                n=0,
                horizon_step=h,
                predicted_peak_mib=0.0,
                upper_mib=0.0,
                at_step=h,
                observed_peak_mib=0.0,
                slope=0.0,
                intercept=0.0,
                sigma=0.0,
                multiplier=0.0,
                context_mib=0.0,
                converged=False,
                spread_mib=math.inf,
                needed_mib=0,
                note=note or f"no {series or 'memory'} samples",
            )
            return empty, None
        last = self._last_step if self._last_step is not None else h
        grid = [last + (h - last) * i / _GRID_INTERVALS for i in range(_GRID_INTERVALS + 1)]
        current = curves[-1]
        k = policy.multiplier(current.df)

        def peaks(curve: _Curve) -> tuple[float, float, float]:
            best_point, best_upper, best_step = -math.inf, -math.inf, grid[-1]
            for x in grid:
                point, se = curve.at(x)
                best_point = max(best_point, point)
                if point + k * se > best_upper:
                    best_upper, best_step = point + k * se, x
            return best_point, best_upper, best_step

        point, upper, at_step = peaks(current)
        if observed >= upper:
            upper, at_step = observed, observed_step
        point = max(point, observed)

        # Convergence ([MIG-HT] Algorithm 1 reports only once the prediction settles):
        # the point forecasts made after each of the last few samples must agree.
        usable = [c for c in curves if c.fit.n >= 3]
        converged = False
        spread = math.inf
        forecasts: list[float] = []
        if len(usable) >= policy.convergence_window:
            forecasts = [max(peaks(c)[0], observed) for c in usable[-policy.convergence_window :]]
            spread = max(forecasts) - min(forecasts)
            tolerance = max(
                policy.convergence_rel_tol * abs(forecasts[-1]), policy.convergence_abs_mib
            )
            converged = spread <= tolerance
        fit = current.fit
        ratio = current.ratio
        result = Forecast(
            series=series,
            n=fit.n,
            horizon_step=h,
            predicted_peak_mib=point,
            upper_mib=upper,
            at_step=at_step,
            observed_peak_mib=observed,
            slope=fit.slope,
            intercept=fit.intercept,
            sigma=fit.sigma,
            multiplier=k,
            context_mib=0.0 if series == "used" else self.context_mib,
            converged=converged,
            spread_mib=spread,
            needed_mib=policy.needed_mib(upper),
            note=note,
            recent_peaks_mib=tuple(forecasts),
            ratio_slope=None if ratio is None else ratio.slope,
            ratio_intercept=None if ratio is None else ratio.intercept,
        )
        return result, current

    def needed_mib(self, horizon: float | None = None) -> int:
        """The smallest partition (MiB) the forecast says the job fits into up to ``horizon``."""
        return self.forecast(horizon).needed_mib

    def verdict(self, limit_mib: float, horizon: float | None = None) -> Verdict:
        """Decide whether the job will outgrow a ``limit_mib`` partition by ``horizon``.

        Fires when at least ``min_samples`` samples were seen, the fit has converged,
        and the upper band anywhere between now and the horizon exceeds
        ``limit_mib - margin``. Never raises: a bad limit or too few samples give
        ``fire=False`` with the reason.
        """
        fc, curve = self._forecast(horizon)
        policy = self.policy
        limit_ok = (
            not isinstance(limit_mib, bool)
            and isinstance(limit_mib, int | float)
            and math.isfinite(limit_mib)
            and limit_mib > 0
        )
        limit = float(limit_mib) if limit_ok else 0.0
        threshold = limit - policy.margin_mib(limit) if limit_ok else 0.0

        def verdict(fire: bool, reason: str, crossing: float | None = None) -> Verdict:
            return Verdict(
                fire=fire,
                predicted_peak_mib=fc.predicted_peak_mib,
                upper_mib=fc.upper_mib,
                at_step=fc.at_step,
                slope=fc.slope,
                intercept=fc.intercept,
                sigma=fc.sigma,
                n=fc.n,
                reason=reason,
                series=fc.series,
                limit_mib=limit,
                threshold_mib=threshold,
                horizon_step=fc.horizon_step,
                converged=fc.converged,
                crossing_step=crossing,
                needed_mib=fc.needed_mib,
            )

        if not limit_ok:
            return verdict(False, f"no usable partition limit ({limit_mib!r}); not forecasting")
        if curve is None or fc.series is None or fc.n == 0:
            return verdict(False, "no usable memory samples yet")
        if fc.n < policy.min_samples:
            return verdict(False, f"{fc.n} of {policy.min_samples} {fc.series} samples needed")
        band = f"{policy.confidence:.0%} {'one' if policy.one_sided else 'two'}-sided"
        summary = (
            f"{fc.series}: peak {fc.predicted_peak_mib:.0f} MiB, upper {band} "
            f"{fc.upper_mib:.0f} MiB at step {fc.at_step:g} (horizon {fc.horizon_step:g}); "
            f"threshold {threshold:.0f} of {limit:.0f} MiB"
        )
        if fc.note:
            summary += f"; {fc.note}"
        if fc.upper_mib <= threshold:
            return verdict(False, f"fits: {summary}")
        # A forecast that keeps rising (convex growth) never settles within the
        # tolerance, yet the decision it supports is settled once even the *point*
        # forecasts of the last few samples all exceed the threshold.
        consistently_over = bool(fc.recent_peaks_mib) and min(fc.recent_peaks_mib) > threshold
        if not (fc.converged or consistently_over):
            return verdict(
                False,
                f"not converged (last {policy.convergence_window} forecasts spread "
                f"{fc.spread_mib:.0f} MiB): {summary}",
            )
        crossing = self._crossing(fc, curve, threshold)
        when = f"; crosses near step {crossing:.0f}" if crossing is not None else ""
        how = "converged" if fc.converged else "last forecasts all over the threshold"
        return verdict(True, f"will not fit ({how}): {summary}{when}", crossing)

    def _crossing(self, fc: Forecast, curve: _Curve, threshold: float) -> float | None:
        """First step in [now, horizon] at which the upper band reaches ``threshold``."""
        last = self._last_step if self._last_step is not None else fc.horizon_step
        if fc.observed_peak_mib > threshold:
            return last

        def upper(x: float) -> float:
            point, se = curve.at(x)
            return point + fc.multiplier * se

        h = fc.horizon_step
        previous = last
        if upper(previous) >= threshold:
            return previous
        for i in range(1, _GRID_INTERVALS + 1):
            x = last + (h - last) * i / _GRID_INTERVALS
            if upper(x) >= threshold:
                lo, hi = previous, x
                for _ in range(60):
                    mid = 0.5 * (lo + hi)
                    if upper(mid) >= threshold:
                        hi = mid
                    else:
                        lo = mid
                return hi
            previous = x
        return None
