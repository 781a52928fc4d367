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

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from gemma4_conformance.spec.compiled import from_bits, jit, nan_max, two_sum


@intrinsic
def _bits(typingctx, x):
    """float64's bits as an int64 (a bit cast, no arithmetic)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return numba.int64(numba.float64), codegen


@jit
def _ulp_exponent(scale, precision, emin, max_finite):
    """k of ``spec.scale_ulp`` of one element, 2^k: max(e, emin) - (precision - 1), e = floor(log2 |scale|),
    read from float64's exponent field."""
    magnitude = abs(scale)
    if not math.isfinite(magnitude):
        magnitude = max_finite
    e = emin if magnitude == 0 else max(((_bits(magnitude) >> 52) & 0x7FF) - 1023, emin)  # a subnormal's is below emin
    return e - (precision - 1)


@jit
def _power_of_two(k):
    """2^k, k at least float64's least subnormal exponent."""
    return math.ldexp(1.0, k) if k < -1022 else from_bits((k + 1023) << 52)


@jit
def _scale_ulp(scale, precision, emin, max_finite):
    """``spec.scale_ulp`` of one element."""
    return _power_of_two(_ulp_exponent(scale, precision, emin, max_finite))


@jit
def _bounds(g, mid, mid_low, rad, slack):
    """From an enclosure (mid + mid_low) ± rad of an exact result (mid_low 0 but for a double word,
    ``spec.enclosures.DoubleWord``): the radius about mid, the float64 exact64 (rad + |mid_low|; inf where
    rad does not bound: nan, or mid not finite), |g - mid - mid_low| and its low and high bounds
    (``judging._SLACK``).  g - mid is exact as TwoSum's s + t: s + (t - mid_low) rounds at most three
    times (once where t is 0, and where it is not, |g - mid| > |mid| / 2 dwarfs mid_low)."""
    r = rad
    if r != r or not math.isfinite(mid):
        r = math.inf
    if mid_low == 0 or not math.isfinite(g):
        d = abs(g - mid)
    else:
        s, t = two_sum(g, -mid)
        d = abs(s + (t - mid_low))
    exact_rad = (r + abs(mid_low)) * (1 + slack)
    return exact_rad if math.isfinite(exact_rad) else math.inf, d, nan_max(d - r, 0.0) * (1 - slack), \
        (d + r) * (1 + slack)


@jit
def stage_bounds(got, mid, mid_low, rad, slack):
    """``_bounds`` of every element, as arrays (radius, error, low, high); ``mid_low`` empty: all 0."""
    n = got.size
    lows = mid_low.size > 0
    radius, error, low, high = np.empty(n), np.empty(n), np.empty(n), np.empty(n)
    for i in range(n):
        radius[i], error[i], low[i], high[i] = _bounds(got[i], mid[i], mid_low[i] if lows else 0.0, rad[i], slack)
    return radius, error, low, high


@jit
def _answer_distance(answer, exact, rad, slack):
    """``distance(answer, 0)`` of the judging: |answer - exact| + 0 rad (nan where rad is inf)."""
    return nan_max(abs(answer - exact) + 0 * rad * (1 + slack), 0.0)


@jit
def _admits(apart, rad, allowance, slack, within, surely, beyond):
    """Fold one element into (all within, all surely within, any surely beyond) the allowance."""
    return (within and apart <= allowance, surely and apart + rad * (1 + slack) <= allowance * (1 - slack),
            beyond or apart - rad * (1 + slack) > allowance * (1 + slack))


@jit
def verdict_units(got, exact, rad, exact_low, error, error_low, error_high, scale, absolute, right_inf,
                  undecided_in, allowed, precision, emin, max_finite, slack, ulps, ulps_high, undecided):
    """One pass of ``judging._judge`` over its elements (all arrays flat, float64; ``absolute`` may hold one value
    for all; ``right_inf`` and ``undecided_in`` empty where every output is finite). ``error`` and its bounds empty:
    ``exact`` and ``rad`` are an enclosure's mid and radius (and ``exact_low`` a double word's low part, or empty),
    whose bounds (``_bounds``) it makes as it goes.  Writes the ULPs, their upper bounds (unless ``ulps_high`` is
    empty) and the undecided elements; returns how many ULPs are not finite, the first zero-scale element, the worst
    over-budget element (-1: none), the largest lower and upper bounds of the ULPs (the contenders' test), whether
    any radius is positive, and (all within, all surely within, any surely beyond) the allowance for zeros and for
    the sign flipped."""
    n = got.size
    keep_high = ulps_high.size > 0
    enclosed = error.size == 0
    lows = exact_low.size > 0
    flags = right_inf.size > 0
    zero_first, worst, worst_ulps = -1, -1, -1.0
    least, most = -math.inf, -math.inf
    not_finite = 0
    step = 1 if absolute.size > 1 else 0
    uncertain = False
    z_within, z_surely, z_beyond = True, True, False  # zeros
    f_within, f_surely, f_beyond = True, True, False  # the sign flipped
    binade = 2.0**(precision - 1)  # a scale's ULP times this is the bottom of its binade
    sure = allowed * (1 - slack)
    a_constant = absolute[0] / allowed if n > 0 else 0.0
    zero_over = 0.0 / allowed
    least_normal = 2.0**emin
    for i in range(n):
        g, e, r, s, a = got[i], exact[i], rad[i], scale[i], absolute[i * step]
        if enclosed:
            r, err, err_low, err_high = _bounds(g, e, exact_low[i] if lows else 0.0, r, slack)
        else:
            err, err_low, err_high = error[i], error_low[i], error_high[i]
        finite = math.isfinite(g)
        k = _ulp_exponent(s, precision, emin, max_finite)
        spacing = _power_of_two(k)
        # Below a sixteenth of spacing's own ULP, a / allowed leaves spacing + it at spacing: it is not computed
        # (a float64 target's absolute allowance is near 2^-1022, and the quotient a subnormal number, each
        # costing the CPU about a hundred cycles; the compiler computes both sides of a branch, so what is
        # chosen is the dividend).
        negligible = not a >= allowed * spacing * 2.0**-56  # nan too, as before
        below = nan_max(s - r, 0.0)
        same = math.isfinite(s) and below >= spacing * binade  # s - r in s's binade: the same ULP
        if finite and negligible and same and k >= -1022 and zero_over == 0:
            # Most elements: the unit is 2^k at both ends, and times 2^-k is the same quotient (no division).
            a_unit = zero_over
            inverse = from_bits((1023 - k) << 52)
            u, u_high = err * inverse, err_high * inverse
        else:
            a_over = a_constant if step == 0 else (0.0 if negligible else a) / allowed  # one allowance for all: once
            a_unit = zero_over if negligible else a_over
            unit = spacing + a_unit
            if same:
                unit_low = unit
            elif math.isfinite(s) and s < least_normal:  # s - r too is below D's normal numbers: the same ULP
                unit_low = spacing + (a_over if not negligible else a / allowed)
            else:
                unit_low = _scale_ulp(below, precision, emin, max_finite) + (a_over if not negligible else a / allowed)
            u = err / unit if finite else math.inf
            u_high = err_high / unit_low if finite else math.inf
        right = flags and right_inf[i]
        if right:
            u = 0.0
        und = flags and undecided_in[i] and (not right or abs(e) <= r)
        zero_scale = s == 0 and a == 0 and finite and err != 0
        if finite and a == 0 and s > 0 and s <= r:
            und = True
        if zero_scale and r > 0:
            und = True
        if finite and not zero_scale and u > allowed and u > worst_ulps:
            worst, worst_ulps = i, u
        if zero_scale and zero_first < 0:
            zero_first = i
        if finite and not zero_scale and not u_high <= sure and r > 0:
            und = True
        ulps[i], undecided[i] = u, und
        if keep_high:
            ulps_high[i] = u_high
        if not math.isfinite(u):
            not_finite += 1
        if r > 0:
            uncertain = True
        allowance = allowed * spacing + a
        if z_within or z_surely or not z_beyond:  # once all three are settled no element changes them
            z_within, z_surely, z_beyond = _admits(_answer_distance(0.0, e, r, slack), r, allowance, slack,
                                                   z_within, z_surely, z_beyond)
        if f_within or f_surely or not f_beyond:
            f_within, f_surely, f_beyond = _admits(_answer_distance(-e, e, r, slack), r, allowance, slack,
                                                   f_within, f_surely, f_beyond)
        if finite and not right:
            most = nan_max(most, u_high)
            if not u <= least:  # the error's lower bound is at most u: below least it leaves it as it is
                low = err_low / (_scale_ulp(s + r, precision, emin, max_finite) + a_unit)
                least = nan_max(least, low)
    return not_finite, zero_first, worst, least, most, uncertain, \
        (z_within, z_surely, z_beyond), (f_within, f_surely, f_beyond)


@jit
def admits(answer, exact, rad, scale, absolute, allowed, precision, emin, max_finite, slack):
    """(all within, all surely within, any surely beyond) the allowance, for one more trivial answer."""
    within, surely, beyond = True, True, False
    step = 1 if absolute.size > 1 else 0
    for i in range(answer.size):
        allowance = allowed * _scale_ulp(scale[i], precision, emin, max_finite) + absolute[i * step]
        within, surely, beyond = _admits(_answer_distance(answer[i], exact[i], rad[i], slack), rad[i], allowance,
                                         slack, within, surely, beyond)
    return within, surely, beyond


@jit
def tier2_excess(answers, exact, rad, sign, slack, absolute, unit, judged):
    """For each row of ``answers`` (flat answers of the output's size), its largest error in ULPs at the
    second tier's scale (``unit``) beyond the tier's absolute allowance, over the ``judged`` elements
    (0 if none): |answer - exact| + sign rad, at least 0, less the allowance, at least 0, over the unit."""
    out = np.zeros(answers.shape[0])
    for i in range(answers.shape[0]):
        worst = 0.0
        for j in range(answers.shape[1]):
            if judged[j]:
                distance = nan_max(abs(answers[i, j] - exact[j]) + sign * rad[j] * (1 + slack), 0.0)
                worst = nan_max(worst, nan_max(distance - absolute[j], 0.0) / unit[j])
        out[i] = worst
    return out



@jit
def _fold_others(values, h, fold):
    """``values`` folded over every head but h: all (fold 0), any (1)."""
    out = fold == 0
    for other in range(values.size):
        if other != h:
            out = (out and values[other]) if fold == 0 else (out or values[other])
    return out


@jit
def zeroed_heads_admits(heads, count, exact, rad, scale, absolute, allowed, precision, emin, max_finite, slack):
    """``admits`` for each of ``count`` answers, answer h being ``exact`` with the elements of head h zeroed
    (``heads``: each element's head): one pass folds each head's elements as zeroed and as exact, and
    answer h is its own head zeroed with every other head exact (the folds are ands and ors, in any
    order).  Returns [count, 3]: (all within, all surely within, any surely beyond)."""
    zeroed, kept = np.zeros((3, count), dtype=np.bool_), np.zeros((3, count), dtype=np.bool_)
    zeroed[:2], kept[:2] = True, True
    step = 1 if absolute.size > 1 else 0
    for i in range(exact.size):
        h, e, r = heads[i], exact[i], rad[i]
        allowance = allowed * _scale_ulp(scale[i], precision, emin, max_finite) + absolute[i * step]
        zeroed[0, h], zeroed[1, h], zeroed[2, h] = _admits(_answer_distance(0.0, e, r, slack), r, allowance, slack,
                                                           zeroed[0, h], zeroed[1, h], zeroed[2, h])
        kept[0, h], kept[1, h], kept[2, h] = _admits(_answer_distance(e, e, r, slack), r, allowance, slack,
                                                     kept[0, h], kept[1, h], kept[2, h])
    out = np.empty((count, 3), dtype=np.bool_)
    for h in range(count):
        out[h, 0] = zeroed[0, h] and _fold_others(kept[0], h, 0)
        out[h, 1] = zeroed[1, h] and _fold_others(kept[1], h, 0)
        out[h, 2] = zeroed[2, h] or _fold_others(kept[2], h, 1)
    return out


@jit
def zeroed_heads_excess(heads, count, exact, rad, sign, slack, absolute, unit, judged):
    """``tier2_excess`` of the answers of ``zeroed_heads_admits``, by the same split: the largest excess of
    head h zeroed and of every other head exact."""
    zeroed, kept = np.zeros(count), np.zeros(count)
    for j in range(exact.size):
        if judged[j]:
            h, e, margin = heads[j], exact[j], sign * rad[j] * (1 + slack)
            zeroed[h] = nan_max(zeroed[h], nan_max(nan_max(abs(0.0 - e) + margin, 0.0) - absolute[j], 0.0) / unit[j])
            kept[h] = nan_max(kept[h], nan_max(nan_max(abs(e - e) + margin, 0.0) - absolute[j], 0.0) / unit[j])
    out = np.empty(count)
    for h in range(count):
        worst = zeroed[h]
        for other in range(count):
            if other != h:
                worst = nan_max(worst, kept[other])
        out[h] = worst
    return out
