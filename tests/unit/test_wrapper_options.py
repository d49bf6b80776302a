"""The wrapper's pydantic-free reading of ``[wrapper]`` agrees with the section's model."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

import annotated_types
from hypothesis import given, settings
from hypothesis import strategies as st

from migd.daemon.config import example_toml
from migd.wrapper_options import RULES, Rule, WrapperOptions, quick_options
from migd.wrapper_section import WrapperSection

REPO = Path(__file__).resolve().parents[2]


def rule_of(name: str) -> Rule:
    """The :class:`Rule` the model's field implies."""
    info = WrapperSection.model_fields[name]
    bounds: dict[str, float] = {}
    for meta in info.metadata:
        for bound in ("gt", "ge", "lt", "le"):
            if isinstance(meta, getattr(annotated_types, bound.capitalize())):
                bounds[bound] = getattr(meta, bound)
    annotation = info.annotation
    args = typing.get_args(annotation)
    optional = type(None) in args
    if typing.get_origin(annotation) is typing.Literal:
        return Rule("choice", choices=args)
    base = next(a for a in args if a is not type(None)) if optional else annotation
    kind = {float: "float", int: "int", bool: "bool"}[base]  # type: ignore[index]
    return Rule(kind, optional=optional, **bounds)


def test_the_rules_are_the_models() -> None:
    assert list(RULES) == list(WrapperSection.model_fields)
    assert {name: rule_of(name) for name in RULES} == RULES


def test_the_defaults_are_the_models() -> None:
    model = WrapperSection()
    options = WrapperOptions()
    values = [f.name for f in dataclasses.fields(WrapperOptions) if f.init]
    assert values == list(RULES)
    assert {n: getattr(options, n) for n in values} == model.model_dump()
    assert (options.forecast, options.oom) == (model.forecast, model.oom)


def test_the_shipped_file_takes_the_quick_path() -> None:
    """``migd --print-example-config`` writes every key: no pydantic for it."""
    section = tomllib.loads(example_toml())["wrapper"]
    assert set(section) == {n for n in RULES if getattr(WrapperOptions(), n) is not None}
    assert quick_options(section) == WrapperOptions(**section)


TEXTS = [
    "0",
    "1",
    "2.5",
    "-1",
    "-0.5",
    "007",
    "1e3",
    "1_0",
    " 2",
    "nan",
    "inf",
    "true",
    "False",
    "yes",
    "1.",
    ".5",
    "３",
    "info",
    "debug",
    "DEBUG",
    "auto",
    "used",
    "vram",
    "",
]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5000),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 0.51, 0.99, 1.0, 3600.0, 3600.5, 1e308]),
    st.sampled_from(TEXTS),
    st.text(max_size=4),
)


def near(name: str) -> st.SearchStrategy[Any]:
    """Values around a field's bounds and default, typed and as text."""
    rule, default = RULES[name], getattr(WrapperOptions(), name)
    points: list[Any] = [default, *rule.choices]
    for bound in (rule.gt, rule.ge, rule.lt, rule.le):
        if bound is not None:
            points += [bound, bound + 0.5, bound - 0.5, bound + 1, int(bound), int(bound) + 1]
    return st.sampled_from(points + [str(x) for x in points if x is not None]) | VALUES


ENTRIES = st.sampled_from([*RULES, "sample_every"]).flatmap(
    lambda name: st.tuples(st.just(name), near(name) if name in RULES else VALUES)
)


@settings(max_examples=600, deadline=None)
@given(st.lists(ENTRIES, max_size=5).map(dict))
def test_the_quick_path_never_accepts_what_the_model_refuses(data: dict[str, Any]) -> None:
    quick = quick_options(data)
    if quick is None:
        return  # the model decides, as before
    model = WrapperSection.model_validate(data)  # raises if the quick path was wrong
    for name in RULES:
        mine, theirs = getattr(quick, name), getattr(model, name)
        assert type(mine) is type(theirs) and mine == theirs, (name, mine, theirs)
    assert (quick.forecast, quick.oom) == (model.forecast, model.oom)


def test_the_quick_path_reads_plain_values() -> None:
    """The property above has something to check: typed values and plain text go quick."""
    quick = quick_options(
        {
            "sample_interval_s": "0.5",
            "forecast_min_samples": 8,
            "forecast_z": None,
            "forecast_leverage": "false",
            "log_level": "debug",
            "term_grace_s": 3,
        }
    )
    assert quick is not None
    assert (quick.sample_interval_s, quick.forecast_min_samples, quick.log_level) == (
        0.5,
        8,
        "debug",
    )
    assert quick.term_grace_s == 3.0 and isinstance(quick.term_grace_s, float)
    assert quick.forecast.leverage is False
    for unsure in (
        {"sample_interval_s": 0},
        {"sample_interval_s": "1e3"},
        {"forecast_min_samples": 5.0},
        {"sample_every": 3},
        {"log_level": "DEBUG"},
        {"forecast_confidence": math.nan},
    ):
        assert quick_options(unsure) is None, unsure


def test_a_gpu_jobs_wrapper_does_not_import_pydantic(tmp_path: Path) -> None:
    """With the shipped file's [wrapper] section and an environment override."""
    config = tmp_path / "migd.toml"
    config.write_text(example_toml())
    env = {"MIGD_CONFIG": str(config), "MIGD_WRAPPER_SAMPLE_INTERVAL_S": "1"}
    heavy = ("pydantic", "structlog", "migd.api", "migd.daemon")
    code = (
        "import sys; import migd.wrapper.main; from migd.wrapper.settings import load_settings; "
        f"s = load_settings({env!r}); assert s.section.sample_interval_s == 1.0, s; "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=120,
    ).stdout
    assert out.strip() == "[]"
