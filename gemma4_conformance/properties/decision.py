"""The judging's per-element arithmetic, compiled: one loop over the output for each stage's knowledge
and one for the verdict's (``judging._enclosed`` and ``judging._judge`` call them).

Each loop does, element by element and in the same order of operations, what the judging states in
array terms: the error's bounds from an enclosure, the error in ULPs at the error model's scale and at
the low end of its enclosure, the undecided elements, the first zero-scale and the worst over-budget
element, the extremes that settle the largest error's printed digits, and whether the trivially wrong
answers (zeros, the sign flipped) lie within the allowance.  numba compiles them with IEEE semantics
(no fastmath: no reassociation, no contraction into fused multiply-adds) and numpy's error model (a
division by zero gives inf or nan, as numpy's does).
"""

from __future__ import annotations

import math

import numpy as np

from gemma4_conformance.spec.compiled import jit


@jit
def _nan_max(a, b):
    """np.maximum: nan if either is nan."""
    if a != a or b != b:
        return a + b
    return a if a >= b else b


@jit
def _scale_ulp(scale, precision, emin, max_finite, floats, ints):
    """``spec.scale_ulp`` of one element: 2^(max(e, emin) - (precision - 1)), e = floor(log2 |scale|),
    read from float64's exponent field (``floats`` and ``ints``: two scratch words, one memory)."""
    magnitude = abs(scale)
    if not math.isfinite(magnitude):
        magnitude = max_finite
    floats[0] = magnitude
    e = emin if magnitude == 0 else max(((ints[0] >> 52) & 0x7FF) - 1023, emin)  # a subnormal's is below emin
    e = e - (precision - 1)
    if e < -1022:  # the ULP is subnormal
        return math.ldexp(1.0, e)
    ints[1] = (e + 1023) << 52
    return floats[1]


@jit
def stage_bounds(got, mid, rad, slack):
    """From an enclosure mid ± rad (float64) of each exact result: the radius (inf where it does not
    bound: rad nan or mid not finite), |got - mid| and its low and high bounds (``judging._SLACK``)."""
    n = got.size
    radius, error, low, high = np.empty(n), np.empty(n), np.empty(n), np.empty(n)
    for i in range(n):
        r = rad[i]
        if r != r or not math.isfinite(mid[i]):
            r = math.inf
        d = abs(got[i] - mid[i])
        error[i] = d
        high[i] = (d + r) * (1 + slack)
        low[i] = _nan_max(d - r, 0.0) * (1 - slack)
        exact_rad = r * (1 + slack)  # mid is exact64: it adds nothing
        radius[i] = exact_rad if math.isfinite(exact_rad) else math.inf
    return radius, error, low, high


@jit
def _answer_distance(answer, exact, rad, slack):
    """``distance(answer, 0)`` of the judging: |answer - exact| + 0 rad (nan where rad is inf)."""
    return _nan_max(abs(answer - exact) + 0 * rad * (1 + slack), 0.0)


@jit
def _admits(apart, rad, allowance, slack, state):
    """Fold one element into (all within, all surely within, any surely beyond) the allowance."""
    if not apart <= allowance:
        state[0] = False
    if not apart + rad * (1 + slack) <= allowance * (1 - slack):
        state[1] = False
    if apart - rad * (1 + slack) > allowance * (1 + slack):
        state[2] = True


@jit
def verdict_units(got, exact, rad, error, error_low, error_high, scale, absolute, right_inf, undecided_in,
                  allowed, precision, emin, max_finite, slack):
    """One pass of ``judging._judge`` over its elements (all arrays flat, float64; ``right_inf`` and
    ``undecided_in`` empty where every output is finite).  Returns the ULPs and their upper bounds,
    the undecided elements, the first zero-scale element, the worst over-budget element (-1: none),
    the largest lower and upper bounds of the ULPs (the contenders' test), whether any radius is
    positive, and (all within, all surely within, any surely beyond) the allowance for zeros and for
    the sign flipped."""
    n = got.size
    ulps, ulps_high = np.empty(n), np.empty(n)
    undecided = np.zeros(n, dtype=np.bool_)
    flags = right_inf.size > 0
    zero_first, worst, worst_ulps = -1, -1, -1.0
    least, most = -math.inf, -math.inf
    uncertain = False
    zeros = np.array([True, True, False])
    flipped = np.array([True, True, False])
    floats = np.empty(2)
    ints = floats.view(np.int64)
    for i in range(n):
        g, e, r, s, a = got[i], exact[i], rad[i], scale[i], absolute[i]
        finite = math.isfinite(g)
        spacing = _scale_ulp(s, precision, emin, max_finite, floats, ints)
        unit = spacing + a / allowed
        unit_low = _scale_ulp(_nan_max(s - r, 0.0), precision, emin, max_finite, floats, ints) + a / allowed
        u = error[i] / unit if finite else math.inf
        u_high = error_high[i] / unit_low if finite else math.inf
        right = flags and right_inf[i]
        if right:
            u = 0.0
        und = flags and undecided_in[i] and (not right or abs(e) <= r)
        zero_scale = s == 0 and a == 0 and finite and error[i] != 0
        if finite and a == 0 and s > 0 and s <= r:
            und = True
        if zero_scale and r > 0:
            und = True
        if finite and not zero_scale and u > allowed and u > worst_ulps:
            worst, worst_ulps = i, u
        if zero_scale and zero_first < 0:
            zero_first = i
        if finite and not zero_scale and not u_high <= allowed * (1 - slack) and r > 0:
            und = True
        ulps[i], ulps_high[i], undecided[i] = u, u_high, und
        if r > 0:
            uncertain = True
        allowance = allowed * spacing + a
        _admits(_answer_distance(0.0, e, r, slack), r, allowance, slack, zeros)
        _admits(_answer_distance(-e, e, r, slack), r, allowance, slack, flipped)
        if finite and not right:
            low = error_low[i] / (_scale_ulp(s + r, precision, emin, max_finite, floats, ints) + a / allowed)
            least, most = _nan_max(least, low), _nan_max(most, u_high)
    return ulps, ulps_high, undecided, zero_first, worst, least, most, uncertain, zeros, flipped


@jit
def admits(answer, exact, rad, scale, absolute, allowed, precision, emin, max_finite, slack):
    """(all within, all surely within, any surely beyond) the allowance, for one more trivial answer."""
    state = np.array([True, True, False])
    floats = np.empty(2)
    ints = floats.view(np.int64)
    for i in range(answer.size):
        allowance = allowed * _scale_ulp(scale[i], precision, emin, max_finite, floats, ints) + absolute[i]
        _admits(_answer_distance(answer[i], exact[i], rad[i], slack), rad[i], allowance, slack, state)
    return state
