"""How a report shows a result: numbers as text, and each result's colour class (the page's and the
charts' alike)."""

from __future__ import annotations

import math

from .data import number

WARN_HEADROOM = 1.5  # a passing op with less headroom than this is shown orange
# A budget below this allows the final rounding (0.5 ULP) and terms of formats wider than the dtype, and
# no second rounding in it (which would take it to 1): a result within it is correctly rounded, not a
# near failure, however little headroom 0.5 / 0.5 leaves.
ONE_ROUNDING = 0.75
COLOURS = {"fail": "#e03131", "known": "#9c36b5", "cr": "#0ca678", "warn": "#f08c00", "ok": "#2f9e44",
           "unest": "#1c7ed6", "unsup": "#adb5bd", "notrun": "#868e96", "none": "#dee2e6"}
PASSED = ("ok", "warn", "cr")  # the classes of a passed result


def shown(value) -> str:
    """A number for a reader: 3 significant digits; "inf" and "NaN" spelled out as the JSON and the
    terminal spell them (a glyph some viewers turn into "="); "—" for not measured."""
    x = number(value)
    if x is None:
        return "—"
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e3:
        return f"{x:.3g}"
    if 1e3 <= abs(x) < 1e6:
        return f"{x:.0f}"
    return f"{x:.2e}"


def percent(passed: int, tested: int) -> str:
    """``passed`` of ``tested`` as a whole percentage, rounded down so that 100% means all passed."""
    if not tested:
        return "—"
    p = 100 * passed / tested
    return f"{math.floor(p) if passed < tested else 100:.0f}%"


def status(result: dict | None) -> str:
    """The cell's colour class: fail, known (an excused failure), cr (correctly rounded: passed a budget of
    one rounding), warn (headroom < WARN_HEADROOM), ok, unest (not established: too few informative
    examples), unsup, notrun, none (not tested). Theorems (no headroom) are ok, known, fail, unsup or
    notrun."""
    if result is None:
        return "none"
    outcome, headroom = result["outcome"], number(result.get("headroom"))
    if outcome == "unsupported":
        return "unsup"
    if outcome == "not established":
        return "unest"
    if outcome == "known deviation":
        return "known"
    if outcome in ("failed", "errored") or (headroom is not None and headroom < 1):
        return "fail"
    if outcome == "not run":
        return "notrun"
    budget_ulps = number(result.get("budget_ulps"))
    if budget_ulps is not None and 0 < budget_ulps < ONE_ROUNDING:
        return "cr"
    if headroom is not None and headroom < WARN_HEADROOM:
        return "warn"
    return "ok"


def examples(n: int) -> str:
    """"1 example", "3 examples"."""
    return f"{n} example" if n == 1 else f"{n} examples"


def over(result: dict) -> float | None:
    """How many times its budget the worst example's error is (the reciprocal of the headroom)."""
    m, b = number(result["worst_ulps"]), number(result["budget_ulps"])
    return m / b if m is not None and b else None
