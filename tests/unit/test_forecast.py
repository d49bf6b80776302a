"""The memory forecast (migd.core.forecast, [MIG-HT] §3.2.3).

Expected values come from independent sources: published Student-t tables, the
standard library's ``statistics.linear_regression``, the textbook prediction-interval
formula computed here from raw residuals, and closed-form lines and ratios.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from migd.core.forecast import (
    Forecaster,
    ForecastPolicy,
    LineFit,
    MemorySample,
    student_t_quantile,
)
from migd.errors import ConfigError


def fit_line(xs: Iterable[float], ys: Iterable[float]) -> LineFit:
    """Least-squares fit of ``ys`` against ``xs``, one point at a time as the forecaster
    adds them."""
    fit = LineFit()
    for x, y in zip(xs, ys, strict=False):
        fit = fit.add(float(x), float(y))
    return fit


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def feed_line(
    fc: Forecaster,
    n: int,
    intercept: float,
    slope: float,
    *,
    start: int = 0,
    field: str = "used_mib",
) -> None:
    for i in range(start, start + n):
        fc.add(i, **{field: intercept + slope * i})


# -- statistics -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "df", "table"),
    [
        (0.99, 1, 31.821),
        (0.99, 2, 6.965),
        (0.99, 3, 4.541),
        (0.99, 4, 3.747),
        (0.99, 10, 2.764),
        (0.99, 30, 2.457),
        (0.995, 5, 4.032),
        (0.975, 20, 2.086),
        (0.95, 8, 1.860),
    ],
)
def test_student_t_quantile_matches_published_tables(p: float, df: int, table: float) -> None:
    assert student_t_quantile(p, df) == pytest.approx(table, abs=1e-3)


def test_student_t_tends_to_the_normal_quantile() -> None:
    normal = statistics.NormalDist().inv_cdf(0.99)
    assert student_t_quantile(0.99, 5000) == pytest.approx(normal, abs=1e-3)
    assert student_t_quantile(0.01, 7) == pytest.approx(-student_t_quantile(0.99, 7))


def test_multiplier_one_sided_vs_two_sided() -> None:
    # z for one-sided 99% is 2.326, for two-sided 99% 2.576 (normal tables).
    assert ForecastPolicy(student_t=False).multiplier(10) == pytest.approx(2.3263, abs=1e-4)
    assert ForecastPolicy(student_t=False, one_sided=False).multiplier(10) == pytest.approx(
        2.5758, abs=1e-4
    )
    assert ForecastPolicy(z=3.0).multiplier(2) == 3.0
    assert ForecastPolicy().multiplier(3) == pytest.approx(4.541, abs=1e-3)


@given(
    slope=st.floats(-500, 500),
    intercept=st.floats(-1e5, 1e5),
    n=st.integers(2, 80),
    start=st.floats(0, 2e9),
    spacing=st.floats(0.01, 1000),
)
@FAST
def test_fit_recovers_noiseless_lines(
    slope: float, intercept: float, n: int, start: float, spacing: float
) -> None:
    xs = [start + i * spacing for i in range(n)]
    assume(xs[-1] > xs[0])
    ys = [intercept + slope * (x - start) for x in xs]
    fit = fit_line(xs, ys)
    scale = max(1.0, abs(intercept), abs(slope) * (xs[-1] - start))
    assert fit.slope == pytest.approx(slope, abs=1e-6 * scale / spacing + 1e-9)
    assert fit.predict(start) == pytest.approx(intercept, abs=1e-6 * scale)
    assert fit.sigma <= 1e-6 * scale


@given(st.lists(st.floats(-1e4, 1e4), min_size=3, max_size=60), st.randoms(use_true_random=False))
@FAST
def test_fit_agrees_with_statistics_linear_regression(ys: list[float], rnd: random.Random) -> None:
    xs = sorted({rnd.uniform(0, 1000) for _ in ys})
    ys = ys[: len(xs)]
    assume(len(xs) >= 3)
    reference = statistics.linear_regression(xs, ys)
    fit = fit_line(xs, ys)
    assert fit.slope == pytest.approx(reference.slope, rel=1e-7, abs=1e-7)
    assert fit.intercept == pytest.approx(reference.intercept, rel=1e-7, abs=1e-5)
    residuals = [
        y - (reference.intercept + reference.slope * x) for x, y in zip(xs, ys, strict=True)
    ]
    sigma = math.sqrt(sum(r * r for r in residuals) / (len(xs) - 2))
    # SSE = Syy - Sxy²/Sxx cancels when the points are nearly collinear: the error floor
    # is about sqrt(eps · Syy), a micro-MiB for these ranges.
    floor = 1e-7 * (max(abs(y) for y in ys) + 1) * math.sqrt(len(ys))
    assert fit.sigma == pytest.approx(sigma, rel=1e-6, abs=floor)


def test_prediction_se_is_the_textbook_interval_for_a_new_observation() -> None:
    xs = [1.0, 2.0, 4.0, 5.0, 7.0, 8.0]
    ys = [10.0, 13.0, 17.0, 21.0, 24.0, 30.0]
    fit = fit_line(xs, ys)
    n = len(xs)
    xbar = sum(xs) / n
    sxx = sum((x - xbar) ** 2 for x in xs)
    reference = statistics.linear_regression(xs, ys)
    sse = sum(
        (y - reference.intercept - reference.slope * x) ** 2 for x, y in zip(xs, ys, strict=True)
    )
    s = math.sqrt(sse / (n - 2))
    for x0 in (0.0, 4.5, 20.0, 100.0):
        expected = s * math.sqrt(1 + 1 / n + (x0 - xbar) ** 2 / sxx)
        assert fit.prediction_se(x0) == pytest.approx(expected, rel=1e-9)
        assert fit.prediction_se(x0, leverage=False) == pytest.approx(s, rel=1e-9)
    # Extrapolating further is less certain.
    assert fit.prediction_se(100.0) > fit.prediction_se(20.0) > fit.prediction_se(4.5)


# -- the band -------------------------------------------------------------------------------


@given(
    noise=st.lists(st.floats(-1, 1), min_size=8, max_size=40),
    small=st.floats(1, 50),
    factor=st.floats(1.5, 10),
)
@FAST
def test_band_widens_with_noise(noise: list[float], small: float, factor: float) -> None:
    assume(statistics.pstdev(noise) > 0.05)

    def band(scale: float) -> float:
        fc = Forecaster(ForecastPolicy(convergence_window=1))
        for i, e in enumerate(noise):
            fc.add(i, used_mib=4000 + 10 * i + scale * e)
        result = fc.forecast(horizon=len(noise) * 3)
        # The band is around the fitted line's peak; where a noisy sample already
        # exceeds that, the reported peak is the observed one and the difference is
        # no longer the band (e.g. noise [0, 1, 0, 0, 0, 0, -1, -1] at scale 210).
        assume(result.predicted_peak_mib > result.observed_peak_mib)
        return result.upper_mib - result.predicted_peak_mib

    assert band(small * factor) > band(small)


def test_leverage_and_student_t_widen_the_band_early() -> None:
    rng = random.Random(7)
    values = [5000 + 40 * i + rng.gauss(0, 30) for i in range(6)]

    def upper(policy: ForecastPolicy) -> float:
        fc = Forecaster(policy)
        for i, v in enumerate(values):
            fc.add(i, used_mib=v)
        return fc.forecast(horizon=150).upper_mib

    paper = upper(ForecastPolicy(z=2.576, leverage=False))
    with_leverage = upper(ForecastPolicy(z=2.576))
    with_t = upper(ForecastPolicy())
    assert paper < with_leverage < with_t


# -- decisions ------------------------------------------------------------------------------


@given(
    level=st.floats(100, 30_000),
    gap=st.floats(0.05, 0.9),
    n=st.integers(1, 60),
    horizon=st.one_of(st.none(), st.floats(0, 1e6)),
    field=st.sampled_from(["used_mib", "allocated_mib"]),
)
@FAST
def test_never_fires_on_a_flat_series_below_the_limit(
    level: float, gap: float, n: int, horizon: float | None, field: str
) -> None:
    policy = ForecastPolicy(context_mib=0.0)
    limit = (level + policy.safety_margin_mib) / (1 - max(gap, policy.safety_margin_frac)) + 1
    fc = Forecaster(policy)
    for i in range(n):
        fc.add(i, **{field: level})
        assert not fc.verdict(limit, horizon).fire


def test_flat_noisy_series_well_below_the_limit_does_not_fire() -> None:
    fc = Forecaster()
    for i in range(200):
        fc.add(i, used_mib=6000 + (25 if i % 2 else -25) + (i % 7))
        assert not fc.verdict(9984, horizon=400).fire


@given(
    start=st.floats(1000, 8000),
    slope=st.floats(5, 400),
    crossing_after=st.integers(60, 400),
    horizon_factor=st.floats(2, 5),
    noise_ratio=st.floats(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
@FAST
def test_fires_on_a_steep_series_long_before_it_crosses(
    start: float,
    slope: float,
    crossing_after: int,
    horizon_factor: float,
    noise_ratio: float,
    seed: int,
) -> None:
    """The limit is crossed at ``crossing_after``; the job runs well past it."""
    policy = ForecastPolicy()
    limit = start + slope * crossing_after
    horizon = crossing_after * horizon_factor
    rng = random.Random(seed)
    fc = Forecaster(policy)
    fired_at = None
    for i in range(crossing_after // 2):
        fc.add(i, allocated_mib=start + slope * i + rng.gauss(0, noise_ratio * slope))
        if fc.verdict(limit, horizon).fire:
            fired_at = i
            break
    assert fired_at is not None, "did not fire before half-way to the crossing"


def test_fires_on_convex_growth_whose_forecast_keeps_rising() -> None:
    """Regression: a gate on forecast agreement alone never fired on quadratic growth."""
    fc = Forecaster()
    limit, n_iters = 4864, 40
    fired_at = None
    for i in range(1, n_iters + 1):
        value = 1536 + 7000 * ((i - 1) / (n_iters - 1)) ** 2
        if value > limit:
            break
        fc.add(i, allocated_mib=value)
        verdict = fc.verdict(limit, horizon=n_iters)
        if verdict.fire:
            fired_at = i
            break
    assert fired_at is not None
    assert "over the threshold" in verdict.reason or "converged" in verdict.reason


def test_unsettled_forecast_does_not_fire() -> None:
    policy = ForecastPolicy(min_samples=3, convergence_window=3)
    fc = Forecaster(policy)
    # A zig-zag: every new sample swings the extrapolated peak by thousands of MiB.
    for i, v in enumerate([5000, 5400, 4700, 5900, 4300]):
        fc.add(i, used_mib=v)
    verdict = fc.verdict(9984, horizon=300)
    assert verdict.upper_mib > verdict.threshold_mib  # would fire on the band alone ...
    assert not verdict.fire  # ... but the forecast has not settled
    assert verdict.reason.startswith("not converged")


def test_verdict_fields_and_needed_mib_on_a_clean_line() -> None:
    fc = Forecaster(ForecastPolicy(context_mib=0.0))
    feed_line(fc, 10, 5000, 50, field="allocated_mib")
    verdict = fc.verdict(9984, horizon=200)
    assert verdict.fire
    assert verdict.series == "allocated"
    assert verdict.n == 10
    assert verdict.slope == pytest.approx(50)
    assert verdict.intercept == pytest.approx(5000)
    assert verdict.sigma == pytest.approx(0, abs=1e-6)
    assert verdict.predicted_peak_mib == pytest.approx(5000 + 50 * 200)
    assert verdict.upper_mib == pytest.approx(verdict.predicted_peak_mib, abs=1e-3)
    assert verdict.at_step == pytest.approx(200)
    assert verdict.threshold_mib == pytest.approx(9984 - max(256, 0.03 * 9984))
    # The upper band reaches the threshold where the line does.
    assert verdict.crossing_step == pytest.approx((verdict.threshold_mib - 5000) / 50, abs=1e-3)
    # A partition of needed_mib would not fire; one MiB less would.
    assert not fc.verdict(verdict.needed_mib, horizon=200).fire
    assert fc.verdict(verdict.needed_mib - 1, horizon=200).fire
    json.dumps(verdict.to_dict())


@given(st.floats(0, 1e6), st.floats(0, 2048), st.floats(0, 0.5))
@FAST
def test_needed_mib_is_the_inverse_of_the_threshold(
    upper: float, margin: float, frac: float
) -> None:
    policy = ForecastPolicy(safety_margin_mib=margin, safety_margin_frac=frac)
    needed = policy.needed_mib(upper)
    assert needed - policy.margin_mib(needed) >= upper - 1e-6
    below = needed - 1
    assert below - policy.margin_mib(below) < upper


def test_horizon_defaults_to_the_observed_span_ahead() -> None:
    fc = Forecaster(ForecastPolicy(lookahead_factor=2.0))
    feed_line(fc, 11, 1000, 10, start=100)  # steps 100..110
    result = fc.forecast()
    assert result.horizon_step == pytest.approx(110 + 2 * 10)
    assert result.predicted_peak_mib == pytest.approx(1000 + 10 * 130)
    passed = fc.forecast(horizon=50)  # a horizon already behind us is ignored
    assert passed.horizon_step == pytest.approx(130)
    assert "horizon" in passed.note


# -- which series ---------------------------------------------------------------------------


def test_allocated_plus_context_is_preferred_over_nvml_used() -> None:
    """Reserved memory ratchets up (cache); allocated stays flat: no restart."""
    fc = Forecaster()
    for i in range(30):
        reserved = 6000 + 120 * i  # the cache grows, e.g. fragmentation
        fc.add(i, used_mib=reserved + 500, reserved_mib=reserved, allocated_mib=5000)
    verdict = fc.verdict(9984, horizon=100)
    assert verdict.series == "allocated"
    assert fc.context_mib == pytest.approx(500)
    assert verdict.predicted_peak_mib == pytest.approx(5500)
    assert not verdict.fire

    used_only = Forecaster(ForecastPolicy(series="used"))
    for i in range(30):
        used_only.add(i, used_mib=6500 + 120 * i)
    assert used_only.verdict(9984, horizon=100).fire


def test_context_override_and_missing_context() -> None:
    fc = Forecaster(ForecastPolicy(context_mib=300.0))
    feed_line(fc, 8, 2000, 0, field="allocated_mib")
    assert fc.forecast(10).predicted_peak_mib == pytest.approx(2300)
    no_nvml = Forecaster()
    feed_line(no_nvml, 8, 2000, 0, field="allocated_mib")
    assert no_nvml.forecast(10).predicted_peak_mib == pytest.approx(2000)


def test_reuse_model_combines_requested_and_inverse_ratio() -> None:
    """physical = requested / (1 / reuse_ratio), both fitted linearly ([MIG-HT] §3.2.3)."""
    policy = ForecastPolicy(context_mib=400.0)
    by_ratio, by_allocated = Forecaster(policy), Forecaster(policy)
    for t in range(12):
        requested = 2000 + 600 * t  # MiB requested from the allocator per step
        inverse = 2.0 + 0.1 * t  # grows: more reuse as the run goes on
        by_ratio.add(t, requested_mib=requested, reuse_ratio=1 / inverse)
        by_allocated.add(t, requested_mib=requested, allocated_mib=requested / inverse)
    horizon = 60
    expected = (2000 + 600 * horizon) / (2.0 + 0.1 * horizon) + 400
    # physical(t) = (2000 + 600 t) / (2 + 0.1 t) rises towards 6000 MiB: the peak is at the end.
    for fc in (by_ratio, by_allocated):
        result = fc.forecast(horizon)
        assert result.series == "reuse"
        assert result.predicted_peak_mib == pytest.approx(expected, rel=1e-9)
        assert result.ratio_slope == pytest.approx(0.1)
        assert result.ratio_intercept == pytest.approx(2.0)
        assert result.slope == pytest.approx(600)
    # Falling physical memory: the peak already seen is the forecast.
    falling = Forecaster(policy)
    for t in range(12):
        falling.add(t, requested_mib=8000 + 600 * t, reuse_ratio=1 / (2.0 + 0.25 * t))
    assert falling.forecast(horizon).predicted_peak_mib == pytest.approx(8000 / 2.0 + 400)


def test_reuse_model_never_exceeds_requested_when_ratio_was_always_at_least_one() -> None:
    fc = Forecaster(ForecastPolicy(context_mib=0.0))
    for t in range(10):
        fc.add(t, requested_mib=1000 + 10 * t, reuse_ratio=1 / (3.0 - 0.2 * t))
    # The inverse ratio would extrapolate below 1 (even below 0) by step 60.
    result = fc.forecast(60)
    assert result.predicted_peak_mib <= 1000 + 10 * 60 + 1e-6
    assert math.isfinite(result.upper_mib)


# -- degenerate input -----------------------------------------------------------------------


def test_too_few_samples_never_fire_and_say_why() -> None:
    fc = Forecaster()
    assert not fc.verdict(1000).fire
    assert "no usable" in fc.verdict(1000).reason
    fc.add(0, used_mib=5000)
    fc.add(1, used_mib=9000)
    verdict = fc.verdict(1000, horizon=100)
    assert not verdict.fire
    assert "2 of 5" in verdict.reason


def test_constant_series_has_no_slope_and_no_spread() -> None:
    fc = Forecaster()
    feed_line(fc, 20, 4321, 0)
    result = fc.forecast(1000)
    assert result.slope == 0
    assert result.sigma == 0
    assert result.predicted_peak_mib == pytest.approx(4321)
    assert result.upper_mib == pytest.approx(4321)
    assert result.converged


def test_bad_samples_are_counted_not_raised() -> None:
    fc = Forecaster()
    assert fc.add(5, used_mib=1000)
    assert not fc.add(5, used_mib=1000)  # same step
    assert not fc.add(4, used_mib=1000)  # time went backwards
    assert not fc.add(math.nan, used_mib=1000)
    assert not fc.add(6, used_mib=math.nan, allocated_mib=-5)
    assert fc.add(7, used_mib=1100)
    assert fc.rejected == {"step_not_increasing": 2, "bad_step": 1, "no_memory_figure": 1}
    assert fc.accepted == 2


def test_warmup_samples_are_ignored() -> None:
    fc = Forecaster(ForecastPolicy(warmup_steps=10))
    for t in range(10):
        assert not fc.add(t, used_mib=100 * t)  # loading: steep but irrelevant
    feed_line(fc, 10, 3000, 0, start=10)
    assert fc.forecast(100).slope == 0
    assert fc.rejected["warmup"] == 10


@pytest.mark.parametrize("limit", [0, -5, math.nan, math.inf, None, True])
def test_unusable_limits_do_not_fire(limit: object) -> None:
    fc = Forecaster()
    feed_line(fc, 10, 5000, 100)
    verdict = fc.verdict(limit, horizon=100)  # type: ignore[arg-type]
    assert not verdict.fire
    assert "limit" in verdict.reason


numbers = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(1e-310, 1e-300),
    st.floats(1e300, 1e308),
    st.integers(-(10**20), 10**20),
    st.booleans(),
)


@given(
    st.lists(
        st.tuples(numbers, numbers, numbers, numbers, numbers, numbers), min_size=0, max_size=40
    ),
    numbers,
    numbers,
)
@FAST
def test_garbage_never_raises(
    rows: list[tuple[object, ...]], limit: object, horizon: object
) -> None:
    fc = Forecaster(ForecastPolicy(min_samples=3, convergence_window=2))
    for row in rows:
        fc.observe(MemorySample(*row))  # type: ignore[arg-type]
        verdict = fc.verdict(limit, horizon)  # type: ignore[arg-type]
        assert isinstance(verdict.fire, bool)
        assert math.isfinite(verdict.upper_mib) and math.isfinite(verdict.predicted_peak_mib)
        json.dumps(verdict.to_dict(), allow_nan=False)
    fc.needed_mib(horizon)  # type: ignore[arg-type]


# -- policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [
        ({"confidence": 1.0}, "forecast.confidence"),
        ({"confidence": 0.3}, "forecast.confidence"),
        ({"min_samples": 2}, "forecast.min_samples"),
        ({"convergence_window": 0}, "forecast.convergence_window"),
        ({"safety_margin_frac": 1.0}, "forecast.safety_margin_frac"),
        ({"safety_margin_mib": -1.0}, "forecast.safety_margin_mib"),
        ({"z": math.nan}, "forecast.z"),
        ({"series": "reserved"}, "forecast.series"),
        ({"context_mib": -3.0}, "forecast.context_mib"),
    ],
)
def test_policy_rejects_bad_values(kwargs: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError) as info:
        ForecastPolicy(**kwargs)  # type: ignore[arg-type]
    assert info.value.where == where
