"""spec.formats: one rounding into each format (round_to), ULP distances and ULP sizes."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mp, mpf

from gemma4_conformance import spec
from gemma4_conformance.spec import FORMATS

NAMES = tuple(FORMATS)


def dyadic(man: int, exp: int) -> mpf:
    """man * 2^exp as an mpf, exactly (built at mpmath's ambient 53 bits it could be rounded)."""
    with mp.workprec(max(abs(man).bit_length(), 2)):
        return mp.ldexp(mpf(man), exp)


def smallest_normal(name: str) -> float:
    return math.ldexp(1, FORMATS[name].emin)


def from_bits(pattern: int, name: str):
    f = FORMATS[name]
    return np.array([pattern], dtype=f.uint).view(f.dtype)[0]


def assert_same_bits(actual, expected, name: str, x=None):
    f = FORMATS[name]
    a = np.ascontiguousarray(actual, dtype=f.dtype).view(f.uint)
    b = np.ascontiguousarray(expected, dtype=f.dtype).view(f.uint)
    np.testing.assert_array_equal(a, b, err_msg=f"{name}: bit patterns differ for inputs {x!r}")


def _not_negative_zero(x: float) -> bool:
    return not (x == 0 and math.copysign(1.0, x) < 0)


def midpoints(name: str):
    """Exact midpoints between two adjacent finite values of the format, of either sign (float32 and
    float64 hold them exactly: they need the format's precision plus one bit)."""
    f = FORMATS[name]
    below_max = int(np.array([f.max_finite], dtype=f.dtype).view(f.uint)[0]) - 1

    def midpoint(pattern: int, negative: bool) -> float:
        lo, hi = float(from_bits(pattern, name)), float(from_bits(pattern + 1, name))
        return -(lo + hi) / 2 if negative else (lo + hi) / 2

    return st.builds(midpoint, st.integers(0, below_max), st.booleans())


def inputs(name: str, width: int = 64):
    """Floats of ``width`` bits aimed at the interesting parts of format ``name``: anywhere, its
    subnormal range, its underflow to zero, its overflow threshold, and exact ties between neighbours."""
    f = FORMATS[name]
    small, sub = 4 * smallest_normal(name), 4 * f.smallest_subnormal
    top = min(2 * f.max_finite, float(np.finfo(np.float32).max) if width == 32 else math.inf)
    return st.one_of(
        st.floats(allow_nan=False, width=width),
        st.floats(-small, small, width=width),
        st.floats(-sub, sub, width=width),
        st.floats(-top, top, width=width),
        midpoints(name),
    ).filter(_not_negative_zero)  # see test_round_to_keeps_the_sign_of_a_negative_zero_input


def arrays_of(strategy):
    return st.lists(strategy, min_size=1, max_size=32).map(lambda xs: np.array(xs, dtype=np.float64))


# --- round_to against exact casts -------------------------------------------------------------

@pytest.mark.parametrize("name", ["float32", "float16"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_round_to_matches_numpy_cast_of_float64(name, data):
    # numpy's float64 -> float32 and float64 -> float16 casts round once, to nearest even.
    x = data.draw(arrays_of(inputs(name)))
    with np.errstate(over="ignore"):
        expected = x.astype(FORMATS[name].dtype)
    assert_same_bits(spec.round_to(x, name), expected, name, x)


@settings(max_examples=150, deadline=None)
@given(x=arrays_of(inputs("bfloat16", width=32)))
def test_round_to_bfloat16_matches_ml_dtypes_cast_of_float32_values(x):
    # ml_dtypes casts float64 -> bfloat16 through float32 (two roundings: 1 + 2^-8 + 2^-30 gives 1.0,
    # not 1 + 2^-7), so its cast is a single rounding only for values float32 holds exactly.
    assert_same_bits(spec.round_to(x, "bfloat16"), x.astype(np.float32).astype(ml_dtypes.bfloat16), "bfloat16", x)


def bfloat16_by_round_to_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> bfloat16 with one rounding: round to odd into float32 (24 >= 8 + 2 bits, same
    exponent range), then to nearest even; round-to-odd then nearest is a single rounding (Boldo and
    Melquiond, "Emulation of FMA and correctly rounded sums", 2008)."""
    with np.errstate(over="ignore"):
        nearest = x.astype(np.float32)
        toward_zero = np.where(np.abs(nearest.astype(np.float64)) > np.abs(x), np.nextafter(nearest, np.float32(0)),
                               nearest)
        away = np.where(x < 0, -np.inf, np.inf).astype(np.float32)
        odd = np.where(toward_zero.view(np.uint32) & 1, toward_zero, np.nextafter(toward_zero, away))
    return np.where(nearest.astype(np.float64) == x, nearest, odd).astype(ml_dtypes.bfloat16)


@settings(max_examples=150, deadline=None)
@given(x=arrays_of(inputs("bfloat16")))
def test_round_to_bfloat16_matches_single_rounding_of_any_float64(x):
    assert_same_bits(spec.round_to(x, "bfloat16"), bfloat16_by_round_to_odd(x), "bfloat16", x)


@settings(max_examples=100, deadline=None)
@given(x=arrays_of(st.floats(allow_nan=False).filter(_not_negative_zero)))
def test_round_to_float64_returns_float64_inputs_unchanged(x):
    assert_same_bits(spec.round_to(x, "float64"), x, "float64", x)


# --- ties, double rounding, underflow and overflow, built from integers -------------------------

def tie_cases():
    """(format, what, exact input, expected) at ties, which go to the even significand, and at the
    underflow and overflow thresholds."""
    cases = []
    for name, f in FORMATS.items():
        p, sub = f.precision, f.smallest_subnormal
        top = f.emax - p  # exponent of half an ULP of the top binade
        cases += [
            (name, "1 + half ulp -> 1 (even)", dyadic(2**p + 1, -p), 1.0),
            (name, "1 + 3 half ulps -> 1 + 2 ulps (even)", dyadic(2**p + 3, -p), 1 + math.ldexp(1, 2 - p)),
            (name, "-(1 + 3 half ulps)", dyadic(-(2**p + 3), -p), -(1 + math.ldexp(1, 2 - p))),
            (name, "half the smallest subnormal -> 0", dyadic(1, f.emin - p), 0.0),
            (name, "-half the smallest subnormal -> -0", dyadic(-1, f.emin - p), -0.0),
            (name, "just above half the smallest subnormal -> it", dyadic(2**60 + 1, f.emin - p - 60), sub),
            (name, "-3/4 smallest subnormal -> -it", dyadic(-3, f.emin - p - 1), -sub),
            (name, "3/2 smallest subnormal -> 2 (even)", dyadic(3, f.emin - p), 2 * sub),
            (name, "5/2 smallest subnormal -> 2 (even)", dyadic(5, f.emin - p), 2 * sub),
            (name, "smallest normal - half subnormal -> smallest normal", dyadic(2**p - 1, f.emin - p),
             smallest_normal(name)),
            (name, "max finite + half ulp -> inf", dyadic(2 ** (p + 1) - 1, top), math.inf),
            (name, "-(max finite + half ulp) -> -inf", dyadic(-(2 ** (p + 1) - 1), top), -math.inf),
            (name, "just below max finite + half ulp -> max finite", dyadic(2 ** (p + 61) - 2**60 - 1, top - 60),
             f.max_finite),
        ]
    return cases


@pytest.mark.parametrize("name, what, x, expected", tie_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_round_to_at_ties_and_thresholds(name, what, x, expected):
    with np.errstate(over="ignore"):
        assert_same_bits(spec.round_to(x, name), np.array(expected, dtype=FORMATS[name].dtype), name, x)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_round_to_rounds_once_where_float64_would_round_twice(name):
    p = FORMATS[name].precision
    # 1 + 2^-p is the midpoint of 1 and 1 + 2^(1-p), 1 + 3 2^-p that of 1 + 2^(1-p) and 1 + 2^(2-p);
    # 2^-70 is below float64's resolution at 1, so float64 would land on the tie and round it to even.
    above_even_tie = dyadic(2**70 + 2 ** (70 - p) + 1, -70)
    below_odd_tie = dyadic(2**70 + 3 * 2 ** (70 - p) - 1, -70)
    one_up = 1 + math.ldexp(1, 1 - p)
    assert float(above_even_tie) == 1 + math.ldexp(1, -p)
    assert spec.round_to(float(above_even_tie), name) == 1.0
    assert spec.round_to(above_even_tie, name) == one_up
    assert spec.round_to(float(below_odd_tie), name) == 1 + math.ldexp(1, 2 - p)
    assert spec.round_to(below_odd_tie, name) == one_up


@pytest.mark.parametrize("name", NAMES)
def test_round_to_underflow_of_a_negative_value_is_negative_zero(name):
    f = FORMATS[name]
    tiny = [dyadic(-1, -5000), dyadic(-1, f.emin - f.precision - 1)]  # the second is a quarter subnormal
    result = spec.round_to(np.array(tiny, dtype=object), name)
    assert np.all(result == 0) and np.all(np.signbit(result.astype(np.float64)))


@pytest.mark.parametrize("name", NAMES)
def test_round_to_keeps_shape_and_returns_the_format_dtype(name):
    x = np.full((2, 3), dyadic(3, -1), dtype=object)
    out = spec.round_to(x, name)
    assert out.shape == (2, 3) and out.dtype == FORMATS[name].dtype and np.all(out == 1.5)
    assert spec.round_to(mpf(0.5), name).shape == ()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_round_to_keeps_infinities(name, value):
    assert spec.round_to(mpf(value), name) == value


@pytest.mark.parametrize("name", NAMES)
def test_round_to_keeps_nan(name):
    assert np.isnan(spec.round_to(mp.nan, name).astype(np.float64))


@pytest.mark.parametrize("name", NAMES)
def test_round_to_keeps_the_sign_of_a_negative_zero_input(name):
    assert np.signbit(spec.round_to(np.array([-0.0]), name).astype(np.float64))[0]


# --- ulp_distance ---------------------------------------------------------------------------------

# Bit patterns of 1.0; 1.0 and -1.0 are that many steps from 0 on either side.
ONE_TO_MINUS_ONE = {
    "float64": 9214364837600034816,  # 2 * 0x3FF0000000000000
    "float32": 2130706432,  # 2 * 0x3F800000
    "float16": 30720,  # 2 * 0x3C00
    "bfloat16": 32512,  # 2 * 0x3F80
}
ONE_BITS = {"float64": 0x3FF0000000000000, "float32": 0x3F800000, "float16": 0x3C00, "bfloat16": 0x3F80}


def distance_cases():
    cases = []
    for name, f in FORMATS.items():
        sub, big = f.smallest_subnormal, f.max_finite
        cases += [
            (name, "equal", 1.5, 1.5, 0),
            (name, "+0 vs -0", 0.0, -0.0, 0),
            (name, "1 and the next float up", 1.0, from_bits(ONE_BITS[name] + 1, name), 1),
            (name, "1 and the next float down", 1.0, from_bits(ONE_BITS[name] - 1, name), 1),
            (name, "0 and the smallest subnormal", 0.0, sub, 1),
            (name, "-0 and the smallest subnormal", -0.0, sub, 1),
            (name, "smallest subnormal vs its negative", sub, -sub, 2),
            (name, "largest subnormal and smallest normal", from_bits((1 << (f.precision - 1)) - 1, name),
             smallest_normal(name), 1),
            (name, "1 vs -1", 1.0, -1.0, ONE_TO_MINUS_ONE[name]),
            (name, "max finite vs inf", big, math.inf, 1),
            (name, "-max finite vs -inf", -big, -math.inf, 1),
            (name, "nan vs nan", math.nan, math.nan, 0),
            (name, "nan vs 1", math.nan, 1.0, math.inf),
            (name, "nan vs inf", math.nan, math.inf, math.inf),
        ]
    return cases


@pytest.mark.parametrize("name, what, a, b, expected", distance_cases(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_ulp_distance_hand_checked(name, what, a, b, expected):
    dtype = FORMATS[name].dtype
    a, b = np.array([a], dtype=dtype), np.array([b], dtype=dtype)
    assert spec.ulp_distance(a, b)[0] == expected
    assert spec.ulp_distance(b, a, name)[0] == expected


@pytest.mark.parametrize("name", NAMES)
def test_ulp_distance_counts_adjacent_floats_from_nextafter(name):
    dtype = FORMATS[name].dtype
    x = np.array([-3.0, -1e-5, 0.0, 1.0, 2.0, 100.0], dtype=dtype)
    up = np.nextafter(x, np.array(np.inf, dtype=dtype))
    np.testing.assert_array_equal(spec.ulp_distance(x, up), 1.0)
    np.testing.assert_array_equal(spec.ulp_distance(x, np.nextafter(up, np.array(np.inf, dtype=dtype))), 2.0)


@pytest.mark.parametrize("a", [2.0, 1e308, math.inf])
def test_ulp_distance_across_zero_in_float64_does_not_overflow(a):
    bits = np.array([a]).view(np.uint64)[0]
    assert spec.ulp_distance(a, -a, "float64")[0] == float(2 * int(bits))


# --- ulp ------------------------------------------------------------------------------------------

def spacing_cases():
    cases = []
    for name, f in FORMATS.items():
        p, sub = f.precision, f.smallest_subnormal
        cases += [
            (name, "1.0", 1.0, math.ldexp(1, 1 - p)),
            (name, "-1.0", -1.0, math.ldexp(1, 1 - p)),
            (name, "just below 2", 2 - math.ldexp(1, 1 - p), math.ldexp(1, 1 - p)),
            (name, "2.0", 2.0, math.ldexp(1, 2 - p)),
            (name, "just below 1", 1 - math.ldexp(1, -p), math.ldexp(1, -p)),
            (name, "smallest subnormal", sub, sub),
            (name, "largest subnormal", smallest_normal(name) - sub, sub),
            (name, "smallest normal", smallest_normal(name), sub),
            (name, "max finite", f.max_finite, math.ldexp(1, f.emax + 1 - p)),
            (name, "twice max finite (top binade)", 2 * f.max_finite, math.ldexp(1, f.emax + 1 - p)),
            (name, "inf (top binade)", math.inf, math.ldexp(1, f.emax + 1 - p)),
        ]
    return cases


@pytest.mark.parametrize("name, what, x, expected", spacing_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_ulp_hand_checked(name, what, x, expected):
    assert spec.ulp(x, name) == expected


@pytest.mark.parametrize("name, what, x, expected", spacing_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_scale_ulp_is_ulp_up_to_the_top_binade(name, what, x, expected):
    if what != "twice max finite (top binade)":
        assert spec.scale_ulp(x, name) == expected


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_scale_ulp_goes_on_past_the_largest_finite_value(name):
    """An error model's scale may pass the format's range (float16 attention: 2.98e6) while its
    roundings do not: the unit follows the precision, 2^(floor(log2 s) - p + 1)."""
    # hand-worked: 2 x 65504 = 131008 lies in [2^16, 2^17), 2.98e6 in [2^21, 2^22), 1e300 in [2^996, 2^997)
    expected = {"float16": [(2 * 65504.0, 2.0**(16 - 10)), (2.98367e6, 2048.0)],
                "bfloat16": [(1e300, 2.0**(996 - 7))],
                "float32": [(1e300, 2.0**(996 - 23))]}
    for s, unit in expected[name]:
        assert spec.scale_ulp(s, name) == unit


def test_ulp_at_one_in_each_format():
    assert [float(spec.ulp(1.0, name)) for name in ("float64", "float32", "float16", "bfloat16")] == [
        2.0**-52, 2.0**-23, 2.0**-10, 2.0**-7]


@pytest.mark.parametrize("name", NAMES)
def test_ulp_at_zero_is_the_smallest_subnormal(name):
    assert spec.ulp(0.0, name) == FORMATS[name].smallest_subnormal


def _correct_error(got: float, x) -> float:
    """|got - x| at a precision that holds it exactly, rounded once to float64 by round_to."""
    with mp.workprec(4000):
        return float(spec.round_to(abs(mpf(got) - mpf(x)), "float64"))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_abs_error_is_the_exact_difference_rounded_once(data):
    """Random floats against exact values near them and far from them, subnormal differences,
    differences that overflow float64, zeros, ints and floats as exact values."""
    n = data.draw(st.integers(1, 20))
    got = data.draw(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=n, max_size=n))
    exact = []
    for g in got:
        man = data.draw(st.integers(-(2**130), 2**130))
        exp = data.draw(st.one_of(st.integers(-1250, 900), st.integers(-(10**10), 10**10)))  # and far past float64
        exact.append(data.draw(st.sampled_from([dyadic(man, exp), mpf(g) + dyadic(man, exp - 140), mpf(0),
                                                 int(man), float(g) / 3, -mpf(g)])))
    out = spec.formats.abs_error(np.array(got), np.array(exact, dtype=object))
    expected = np.array([_correct_error(g, x) for g, x in zip(got, exact)])
    assert_same_bits(out, expected, "float64", list(zip(got, exact)))


@pytest.mark.parametrize("got, x, expected", [
    (5e-324, dyadic(1, -1080), 5e-324),  # 2^-1074 - 2^-1080, a subnormal difference, rounds to 2^-1074
    (1.7e308, -mpf(1.7e308), math.inf),  # the difference overflows
    (1.0, mpf("inf"), math.inf),
    (0.5, mpf(0.5), 0.0),
    (-0.0, mpf(0), 0.0),
    (0.0, -mpf("2.3262134370147845e-8804982661"), 0.0),  # gelu_tanh's oracle far in the tail: no 2^(3e10) shift
    # 2^-1075, half the smallest subnormal, is a tie (to even: 0); bits below 2^-1200 decide the rest
    (0.0, dyadic(1, -1075), 0.0),
    (0.0, dyadic(-(2**1000 + 1), -2075), 5e-324),
    (0.0, dyadic(2**1000 - 1, -2075), 0.0),
    (5e-324, dyadic(-1, -10**9), 5e-324),
    (1.0, mpf(2) ** (10**9), math.inf),
])
def test_abs_error_hand_checked(got, x, expected):
    out = spec.formats.abs_error(np.array([got]), np.array([x], dtype=object))
    assert out[0] == expected
