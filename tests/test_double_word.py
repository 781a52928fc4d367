"""The float64 target's double-word enclosures (spec.compiled's double-word kernels) hold the oracle's exact
results on rows drawn across float64's whole range, and are as tight as they claim where they bound."""

from __future__ import annotations

import mpmath
import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemma4_conformance import spec
from gemma4_conformance.spec import compiled, enclosures
from gemma4_conformance.properties.error_models import head_logits, head_sums, masked_softmax
from gemma4_conformance.properties.table import OPS
from gemma4_conformance.spec.compiled import DOUBLE_WORD_HIGHEST, DOUBLE_WORD_LOWEST

from .test_enclosures import as_mpf

# Magnitudes from the subnormal numbers to past the kernels' range, zeros, and signs.
values = st.one_of(
    st.floats(min_value=-2.0**600, max_value=2.0**600, allow_nan=False, allow_subnormal=True),
    st.integers(-1074, 520).map(lambda e: 2.0**e), st.just(0.0), st.floats(-4, 4, allow_nan=False),
    st.floats(-800, 800, allow_nan=False))  # exp's whole range, and past it
epsilons = st.sampled_from([0.0, 1e-6, 2.0**-1000, 1.0, 2.0**-60])
some = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
TIGHT = 2.0**-68  # relative: tanh's bound is 2^-70, exp's 2^-76, the norms' chains about 2^-82 at H = 3840
ATTENTION = ("causal_gqa", "sliding_gqa", "decode_gqa")


@st.composite
def double_word_cases(draw):
    """(op, args) of a double-word op on 1 to 3 rows of 1 to 9 float64 values."""
    op = draw(st.sampled_from(sorted(enclosures.DOUBLE_WORD)))
    R, H = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    x, z = (np.array(draw(st.lists(values, min_size=R * H, max_size=R * H))).reshape(R, H) for _ in range(2))
    w = np.array(draw(st.lists(values | st.floats(-1.001, -0.999), min_size=H, max_size=H)))
    eps = draw(epsilons)
    if op == "residual":  # h near -x / r as well: x + r h cancels
        r = draw(st.sampled_from([1.0, 0.5, 3.0, 2.0**-1000]))
        near = np.array(draw(st.lists(st.booleans(), min_size=R * H, max_size=R * H))).reshape(R, H)
        others = np.array(draw(st.lists(values, min_size=R * H, max_size=R * H))).reshape(R, H)
        with np.errstate(over="ignore"):
            h = np.where(near, -x / r * (1 + 2.0**-52), others)
        return op, (r, x, h)
    if op in ("rope", "rope_std"):  # positions up to past the angles the kernel takes
        pos = np.array(draw(st.lists(st.integers(0, 2**21) | st.integers(0, 64), min_size=R, max_size=R)))
        theta, rot = draw(st.sampled_from([10000.0, 1e6, 2.0])), draw(st.integers(0, H + 1))
        return op, (theta, rot, rot, rot // 2, pos, x) if op == "rope" else (theta, rot, pos, x)
    if op in ATTENTION:  # logits past exp's range, values that cancel, underflow or pass 2^995
        S, H, G, D = R, draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 6))
        L = S + draw(st.integers(0, 3))
        near = st.floats(-40, 40) | st.just(0.0) | st.integers(-60, 6).map(lambda e: 2.0**e)
        q, k = (np.array(draw(st.lists(near, min_size=n, max_size=n))) for n in (S * H * G * D, L * H * D))
        v = np.array(draw(st.lists(values | st.just(2.0**996), min_size=L * H * D, max_size=L * H * D)))
        q, k, v = q.reshape(S, H, G, D), k.reshape(L, H, D), v.reshape(L, H, D)
        scale, pos = draw(st.sampled_from([1.0, 0.125, 3.0**-0.5, 2.0**-600])), np.arange(L - S, L)
        return op, {"causal_gqa": (scale, pos, q, k, v), "sliding_gqa": (scale, draw(st.integers(1, 3)), pos, q, k, v),
                    "decode_gqa": (scale, q[0], k, v)}[op]
    if op == "embed":
        return op, (draw(st.sampled_from([1.0, 61.97, 2.0**-600, 3.0**30])), x, np.arange(R)[::-1])
    return op, {"rms": (eps, x), "rmsnorm": (eps, x, w), "rmsnorm_offset": (eps, x, w), "rmsnorm_unit": (eps, x),
                "rmsnorm_gated": (eps, x, z, w), "l2norm": (eps, x), "sigmoid": (x,), "silu": (x,),
                "silu_mul": (np.concatenate([x, z], axis=-1),), "sigmoid_gate": (z, x), "gelu_tanh": (x,),
                "gelu_mul": (np.concatenate([x, z], axis=-1),),
                "softcap": (draw(st.sampled_from([30.0, 15.0, 2.0**-20, -3.0, 2.0**900])), x),
                "softmax": (x, np.array(draw(st.lists(st.booleans(), min_size=R * H, max_size=R * H))).reshape(R, H)),
                }[op]


def _magnitude(op, args, high):
    """What a radius is measured against, and the absolute part of the radius, in float64: |result|; for rope
    twice its row's largest input (its cos and sin err absolutely: the pair's |x_i| + |x_j| times that); for
    attention sum_l p_l |v_l| (the weighted sum cancels) and its values' underflow."""
    if op in ("rope", "rope_std"):
        return np.broadcast_to(2 * np.abs(args[-1]).max(axis=-1, keepdims=True), high.shape), 0.0
    if op not in ATTENTION:
        return np.abs(high), 0.0
    inputs = OPS[op].attention
    scale, visible, q, k, v = inputs(args)
    with np.errstate(all="ignore"):
        p, _ = masked_softmax(scale * head_logits(q, k), visible[:, None, None, :])
        magnitude = inputs.output(head_sums(p, np.abs(v)))
    return magnitude, 2.0**-1060 * (visible.shape[-1] + np.abs(v).sum())


def _checked(op, args):
    """The enclosure against the oracle: (bounded elements, in-range bounded elements)."""
    try:
        (high, low), rad = enclosures.ENCLOSURES[op](*args, work=np.longdouble)
    except enclosures.NotEnclosed:
        return 0, 0
    with mpmath.workprec(4096):  # every sum exact: the oracle's squares of 2^600 and of 2^-1074 together
        exact = np.asarray(spec.ORACLES[op](*args), dtype=object).reshape(rad.shape)
        bounded = np.isfinite(rad)
        mid = as_mpf(np.where(bounded, high, 0)) + as_mpf(np.where(bounded, low, 0))
        radius = as_mpf(np.where(bounded, rad, 0))
        for i in zip(*np.nonzero(bounded)):
            assert abs(exact[i] - mid[i]) <= radius[i], (op, args, i, exact[i], mid[i], radius[i])
    magnitude, absolute = _magnitude(op, args, high)
    in_range = bounded & (magnitude >= DOUBLE_WORD_LOWEST) & (magnitude <= DOUBLE_WORD_HIGHEST)
    assert (rad[in_range] <= TIGHT * magnitude[in_range] + absolute).all(), (op, args)
    return int(bounded.sum()), int(in_range.sum())


def test_double_word_enclosures_hold_the_oracle_and_are_tight():
    """Every bounded element's exact result lies within its radius, the radius is at most TIGHT of the
    result where it lies in the kernels' range, and most drawn elements are bounded (the kernels' range
    is not so narrow that the oracle judges everything)."""
    counts = []

    @some
    @given(double_word_cases())
    def drawn(case):
        counts.append(_checked(*case))

    drawn()
    bounded, in_range = map(sum, zip(*counts))
    assert in_range > 0.5 * bounded > 0


def test_a_radius_too_small_is_caught(monkeypatch):
    """The check above fails on rms's enclosure with its radius 2^60 times too small (below the double
    words' own rounding error): it is not empty."""
    right = enclosures.ENCLOSURES["rms"]

    def narrowed(eps, x, *, work):
        (high, low), rad = right(eps, x, work=work)
        return enclosures.DoubleWord(high, low), rad * 2.0**-60

    monkeypatch.setitem(enclosures.ENCLOSURES, "rms", narrowed)
    with pytest.raises(AssertionError):
        _checked("rms", (0.0, np.array([[1.0 + 2.0**-52, 3.0, 2.0**-30, 7.0, 5.0]])))


def test_exp_within_its_bound():
    """The double-word exp under every sigmoid errs by at most 2^-79 relative (the sum of its derived terms;
    EXP_DOUBLE_WORD allows eight times that), and 2^-1074 absolute, across its range, near the reduction's
    boundaries (n ln 2 / 256 + ln 2 / 512) and at its ends."""
    rng = np.random.default_rng(0)
    step = np.log(2) / 256
    y = np.concatenate([rng.uniform(compiled.EXP_LOWEST, compiled.EXP_HIGHEST, 3000), rng.standard_normal(1000),
                        (np.arange(-200, 200) + 0.5) * step, [compiled.EXP_LOWEST, compiled.EXP_HIGHEST, 0.0, 1e-300]])

    @numba.njit
    def each(y):
        high, low = np.empty(y.size), np.empty(y.size)
        for i in range(y.size):
            high[i], low[i] = compiled._exp_double_word(y[i], 0.0)
        return high, low

    high, low = each(y)
    with mpmath.workprec(200):
        worst = max((abs(h + l - mpmath.exp(a)) - mpmath.mpf(2) ** -1074) / mpmath.exp(a)  # a subnormal low part
                    for h, l, a in zip(as_mpf(high), as_mpf(low), as_mpf(y)))
    assert worst <= mpmath.mpf(2) ** -79, float(mpmath.log(worst, 2))


def test_tanh_within_its_bound():
    """The double-word tanh under float64 softcap errs by at most 2^-71 relative (the largest sum of its
    derived terms, the Taylor case's; TANH_DOUBLE_WORD allows twice that) in each of its cases and at
    their boundaries."""
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.uniform(0, 2.0**-5, 500), 2.0 ** rng.uniform(-300, -5, 300), rng.uniform(2.0**-5, 1, 500),
                        rng.uniform(1, 400, 300), [2.0**-5, 2.0**-5 * (1 - 2.0**-52), 353.0, 2.0**-300, 2.0**-301]])
    a = np.concatenate([a, -a])

    @numba.njit
    def each(a):
        high, low = np.empty(a.size), np.empty(a.size)
        for i in range(a.size):
            high[i], low[i], _ = compiled._tanh_double_word(a[i], 0.0, 0.0)
        return high, low

    high, low = each(a)
    with mpmath.workprec(300):
        worst = max(abs(h + l - mpmath.tanh(x)) / abs(mpmath.tanh(x)) for h, l, x in zip(as_mpf(high), as_mpf(low),
                                                                                        as_mpf(a)))
    assert worst <= mpmath.mpf(2) ** -71, float(mpmath.log(worst, 2))


def test_cos_sin_within_their_bound():
    """The double-word cos and sin under float64 rope err by at most 2^-78.5 absolutely (the sum of their
    derived terms; COS_SIN_DOUBLE_WORD allows four times that) up to the largest angle they take, near
    multiples of pi / 2 and of the table's step pi / 128, and at small angles."""
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.uniform(-compiled.COS_SIN_HIGHEST, compiled.COS_SIN_HIGHEST, 1000),
                        rng.uniform(-4, 4, 1000), np.arange(-3000, 3000) * (np.pi / 2),
                        (np.arange(-64, 64) + 0.5) * (np.pi / 128), 2.0 ** rng.uniform(-60, 0, 200), [0.0]])

    @numba.njit
    def each(a):
        out = np.empty((a.size, 4))
        for i in range(a.size):
            out[i, 0], out[i, 1], out[i, 2], out[i, 3] = compiled._cos_sin_double_word(a[i], 0.0)
        return out

    out = each(a)
    with mpmath.workprec(300):
        worst = max(max(abs(ch + cl - mpmath.cos(x)), abs(sh + sl - mpmath.sin(x)))
                    for (ch, cl, sh, sl), x in zip(as_mpf(out), as_mpf(a)))
    assert worst <= mpmath.mpf(2) ** -78.5, float(mpmath.log(worst, 2))


def test_exp_below_its_range_is_bounded_above():
    """``_exp_below``, the bound of a softmax term that underflows and of sigmoid's extreme, is above e^(y + a) /
    (1 - 2^-20), a = 2^-19 + 2^-53 |y|, and within 4 times e^y (or the least positive float64), from -620 down
    to -10^300."""
    y = np.concatenate([np.linspace(-620, -800, 2000), -np.logspace(2.85, 6, 500),
                        [-744.44, -745.13, -745.2, -1e300, compiled.EXP_LOWEST - 2.0**-40]])

    @numba.njit
    def each(y):
        out = np.empty(y.size)
        for i in range(y.size):
            out[i] = compiled._exp_below(y[i])
        return out

    bound = each(y)
    with mpmath.workprec(100):
        for b, a in zip(as_mpf(bound), as_mpf(y)):
            shift = mpmath.mpf(2) ** -19 + abs(a) * mpmath.mpf(2) ** -53
            assert b >= mpmath.exp(a + shift) / (1 - mpmath.mpf(2) ** -20), a
            assert b <= max(4 * mpmath.exp(a), mpmath.mpf(2) ** -1074), a
