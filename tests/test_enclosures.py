"""The enclosures of the judging's first stage (spec.enclosures) hold the oracle's exact results."""

from __future__ import annotations

import math

import mpmath
import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemma4_conformance import spec
from gemma4_conformance.spec import compiled, enclosures, format_of
from gemma4_conformance.properties.table import OPS, build, cases, edge_cases

DTYPES = ("bfloat16", "float16", "float32", "float64")
ENCLOSED = sorted(enclosures.ENCLOSURES)
quick = settings(max_examples=3, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


def as_mpf(a: np.ndarray) -> np.ndarray:
    """float64 or long double values as exact mpf."""
    a = np.asarray(a)
    mantissa, exponent = np.frexp(a)
    digits = np.ldexp(mantissa, 64)
    with mpmath.workprec(128):
        return np.array([mpmath.mpf(int(m)) * mpmath.mpf(2) ** (int(e) - 64) if np.isfinite(m) else mpmath.mpf(float(m))
                         for m, e in zip(digits.ravel(), exponent.ravel())], dtype=object).reshape(a.shape)


def enclose(op, args, dtype):
    return enclosures.ENCLOSURES[op](*args, work=enclosures.work_type(format_of(dtype).precision))


def assert_encloses(op, args, dtype):
    try:
        mid, rad = enclose(op, args, dtype)
    except enclosures.NotEnclosed:
        return
    words = mid if isinstance(mid, enclosures.DoubleWord) else (mid,)
    rad = np.atleast_1d(rad)
    exact = np.asarray(spec.ORACLES[op](*args), dtype=object).reshape(rad.shape)
    bounded = np.isfinite(rad)
    with mpmath.workprec(256):  # a double word's sum exactly
        mid = sum(as_mpf(np.where(bounded, np.reshape(word, rad.shape), 0)) for word in words)
    rad = as_mpf(np.where(bounded, rad, 0))
    outside = [i for i in zip(*np.nonzero(bounded)) if abs(exact[i] - mid[i]) > rad[i]]
    assert not outside, f"{op} {dtype}: exact {exact[outside[0]]} outside {mid[outside[0]]} ± {rad[outside[0]]}"


@pytest.mark.parametrize("op", ENCLOSED)
def test_enclosure_holds_the_oracle(op):
    for dtype in DTYPES:
        for case in edge_cases(op)[:4]:
            assert_encloses(op, build(op, case, dtype), dtype)

        @quick
        @given(st.data())
        def drawn(data):
            assert_encloses(op, build(op, data.draw(cases(op, dtype)), dtype), dtype)

        drawn()


def test_a_wrong_radius_is_caught(monkeypatch):
    """assert_encloses fails on an enclosure whose mid is moved past its radius."""
    right = enclosures.ENCLOSURES["softmax"]

    def moved(*args, work):
        mid, rad = right(*args, work=work)
        return mid + 2 * rad + 1e-30, rad

    monkeypatch.setitem(enclosures.ENCLOSURES, "softmax", moved)
    with pytest.raises(AssertionError, match="outside"):
        assert_encloses("softmax", build("softmax", edge_cases("softmax")[0], "float32"), "float32")


def _elementary_cases():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-8, 3, 4000),
                        rng.uniform(-700, 700, 1000), [16.0757, -16.0757, 0.5, 1e-300, 709.7, -745.0]])
    angles = np.concatenate([rng.uniform(0, 262144, 2000), np.arange(1, 400) * np.pi])
    return x, angles


def _compiled(fn):
    """fn of each element, in a loop numba compiles as spec.compiled's kernels are (LLVM's intrinsics)."""
    @numba.njit(error_model="numpy")
    def each(a):
        out = np.empty(a.size)
        for i in range(a.size):
            out[i] = fn(a[i])
        return out

    return each


COMPILED = {fn.__name__: _compiled(fn) for fn in (math.exp, math.tanh, math.sin, math.cos)}


@pytest.mark.parametrize("work", [np.float64, np.longdouble, "compiled"])
def test_elementary_functions_within_the_bound(work):
    """numpy's exp, tanh, sin, cos and pow (float64), glibc's long double ones, and the exp, tanh, sin
    and cos that numba compiles (spec.compiled) err by at most half the relative error ELEMENTARY
    allows, on random arguments and known hard ones (near exp's overflow and underflow, tanh near 16,
    sin and cos at up to 262144 and near multiples of pi)."""
    x, angles = _elementary_cases()
    fns = {"exp": np.exp, "tanh": np.tanh, "sin": np.sin, "cos": np.cos}
    if work == "compiled":
        work, fns = np.float64, COMPILED
    u = np.finfo(work).eps / 2
    limit = mpmath.mpf(float(enclosures.ELEMENTARY * u / 2))
    x_w, angles_w = x.astype(work), angles.astype(work)
    with mpmath.workprec(160):
        checks = [("exp", mpmath.exp, x_w[np.abs(x) < 700]), ("tanh", mpmath.tanh, x_w),
                  ("sin", mpmath.sin, angles_w), ("cos", mpmath.cos, angles_w)]
        base = np.abs(x_w[:500]) + 1
        exponents = -(x_w[:500] / 50)
        worst = {}
        for name, exact_fn, args in checks:
            got = as_mpf(fns[name](args))
            worst[name] = max(abs(g - exact_fn(a)) / abs(exact_fn(a))
                                     for g, a in zip(got, as_mpf(args)) if exact_fn(a) != 0)
        got = as_mpf(np.power(base, exponents))
        worst["power"] = max(abs(g - mpmath.power(b, e)) / mpmath.power(b, e)
                             for g, b, e in zip(got, as_mpf(base), as_mpf(exponents)))
    assert all(w <= limit for w in worst.values()), {k: float(w / u) for k, w in worst.items()}


def _example(op):
    drawn = []

    @quick
    @given(cases(op, "float32"))
    def keep(case):
        drawn.append(case)

    keep()
    return max(drawn, key=lambda case: str(case))


def test_restrictions_hold_the_masked_elements():
    """Each op's restriction keeps every masked element, at the position its index names, and the
    oracle on it gives the whole oracle's values there (attention's keeps only the value features it
    needs: a part that is no call of the contract, whose v has fewer features than q)."""
    rng = np.random.default_rng(1)
    for op in ENCLOSED:
        entry = OPS[op]
        args = build(op, (edge_cases(op) or [None])[0] or _example(op), "float32")
        shape = spec.CONTRACT[op].output_shape(*args)
        for share in (0.05, 0.0):  # a scattered mask, and one element
            mask = rng.random(shape) < share
            mask.flat[rng.integers(mask.size)] = True
            part, where = entry.restrict(op, args, mask)
            marker = np.zeros(shape, dtype=bool)
            marker[where] = True
            assert marker[mask].all(), op
            whole = np.asarray(entry.oracle(*args), dtype=object).reshape(shape)
            assert (np.asarray(entry.oracle(*part), dtype=object) == whole[where]).all(), op


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(st.integers(1, 300), st.integers(1, 40), st.integers(-1100, 10), st.integers(0, 2**32 - 1))
def test_attention_bounds_from_float64_products_are_upper_bounds(L, D, binade, seed):
    """``_upper_products`` (a float64 target's attention radius, from float64 BLAS) is at least the exact
    sum, down to weights that underflow float64."""
    rng = np.random.default_rng(seed)
    a = rng.random((3, L)) * 2.0**binade
    b = np.abs(rng.standard_normal((L, D))) * 2.0 ** rng.integers(-40, 40)
    upper, a, b = (as_mpf(x) for x in (enclosures._upper_products(a, b), a, b))
    with mpmath.workprec(4000):
        for i, j in np.ndindex(upper.shape):
            assert upper[i, j] >= mpmath.fsum(a[i, l] * b[l, j] for l in range(L)), (i, j)


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(st.integers(1, 300), st.integers(1, 24), st.integers(-1100, 0), st.integers(-1074, 995),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_attention_weighted_sums_as_double_words_hold_their_bound(L, D, p_binade, v_binade, cancel, seed):
    """``compiled.weighted_sums`` (a float64 target's p @ v, p a double word) errs by at most F sum_l p_l |v_l|
    (``_weighted_sums_factor``) + 2^-1071 (L + sum_l |v_l|): down to weights and values that underflow
    float64, through rows that cancel, and up to values of 2^995."""
    rng = np.random.default_rng(seed)
    p_high = rng.random((6, L)) * 2.0**p_binade
    p_low = p_high * rng.uniform(-2.0**-53, 2.0**-53, p_high.shape)  # |low| <= ULP(high) / 2
    v = rng.standard_normal((L, D)) * 2.0**v_binade
    v = np.where(np.abs(v) <= 2.0**995, v, 2.0**995)
    if cancel:  # each value's negation too: the sums cancel to their rounding errors
        v[L // 2:2 * (L // 2)] = -v[:L // 2]
    high, low = np.empty((6, D)), np.empty((6, D))
    compiled.weighted_sums(p_high, p_low, v, high, low)
    factor = enclosures._weighted_sums_factor(L)
    with mpmath.workprec(4000):
        p_exact, v_exact, out = as_mpf(p_high) + as_mpf(p_low), as_mpf(v), as_mpf(high) + as_mpf(low)
        for r, d in np.ndindex(out.shape):
            terms = [p_exact[r, l] * v_exact[l, d] for l in range(L)]
            exact, magnitude = mpmath.fsum(terms), mpmath.fsum(abs(t) for t in terms)
            values = mpmath.fsum(abs(v_exact[l, d]) for l in range(L))
            bound = magnitude * factor + mpmath.mpf(2) ** -1071 * (L + values)
            assert abs(out[r, d] - exact) <= bound, (r, d)
