"""The products' first stage from float64 BLAS (spec.exact.dots_enclosure)
holds the exact sums of spec.exact.dots on every draw, where its a-priori bound is tightest."""

from __future__ import annotations

import importlib

import mpmath
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemma4_conformance.spec import enclosures, format_of

exact_sums = importlib.import_module("gemma4_conformance.spec.exact")  # spec.exact is also a function

NARROW = ("bfloat16", "float16", "float32")
REAL_DEPTHS = (1, 2, 3, 255, 3840, 15360)  # Gemma 4 12B's accumulation depths, and the smallest


def exact_sums_of(a, b):
    with mpmath.workprec(128):
        return np.asarray(exact_sums.dots(a, b, rounded=False), dtype=object)


def as_mpf(value) -> mpmath.mpf:
    """A float64 or long double, exactly."""
    mantissa, exponent = np.frexp(value)
    return mpmath.mpf(int(np.ldexp(mantissa, 64))) * mpmath.mpf(2) ** (int(exponent) - 64)


def outside(exact, mid, rad):
    """Where |exact - mid| > rad, compared exactly (4000 bits hold every float64 and exact sum here)."""
    with mpmath.workprec(4000):
        return [i for i in np.ndindex(exact.shape)
                if not np.isfinite(rad[i]) or abs(exact[i] - as_mpf(mid[i])) > as_mpf(rad[i])]


@st.composite
def operands(draw):
    """Two rows of K values and two of b, in a narrow format: normal values at a drawn binade, the
    format's largest values (products near 2^256), its subnormals, and pairs of large terms that
    cancel exactly or to within a subnormal's product, so that the exact sum is far below its terms."""
    dtype = draw(st.sampled_from(NARROW))
    f = format_of(dtype)
    K = draw(st.sampled_from(REAL_DEPTHS) | st.integers(1, 15360))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "overflow", "subnormal", "cancel"]))
    shape = (2, K)
    if kind == "normal":
        a = rng.standard_normal(shape) * 2.0 ** draw(st.integers(-20, 20))
        b = rng.standard_normal(shape)
    elif kind == "overflow":  # every product near the largest value squared
        a = f.max_finite * rng.uniform(0.5, 1, shape) * rng.choice([-1, 1], shape)
        b = f.max_finite * rng.uniform(0.5, 1, shape) * rng.choice([-1, 1], shape)
    elif kind == "subnormal":
        a = f.smallest_subnormal * rng.integers(-8, 9, shape)
        b = f.smallest_subnormal * rng.integers(-8, 9, shape)
    else:  # large terms that cancel, and a few subnormal products left over
        big = f.max_finite * rng.uniform(0.5, 1, shape)
        a = np.where(np.arange(K) % 2 == 0, big, -np.roll(big, 1, axis=1))
        b = np.ones(shape)
        leftover = rng.random(shape) < 0.05
        a = np.where(leftover, f.smallest_subnormal * rng.integers(1, 4, shape), a)
        b = np.where(leftover, f.smallest_subnormal, b)
    with np.errstate(over="ignore"):  # uniform(0.5, 1) may round up to 1: the format's largest value, still finite
        return a.astype(f.dtype), b.astype(f.dtype)


@settings(max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(operands())
def test_dots_enclosure_holds_the_exact_sums(pair):
    a, b = pair
    mid, rad = exact_sums.dots_enclosure(a, b, np.float64)
    assert np.isfinite(rad).all(), "every product and sum of a narrow format is finite in float64"
    exact = exact_sums_of(a, b)
    assert not outside(exact, mid, rad), f"{a.dtype}, K = {a.shape[-1]}: the exact sum is outside mid ± rad"


def _losing_everything():
    """2^127 2^127 + 2^-149 2^-149 - 2^127 2^127 in float32: float64 loses the middle term whatever the
    order in which its BLAS adds (it is 2^-552 of the others), so mid is 0 and the exact sum 2^-298."""
    top, tiny = np.float32(2.0**127), np.float32(2.0**-149)
    return np.array([[top, tiny, -top]], dtype=np.float32), np.array([[top, tiny, top]], dtype=np.float32)


def test_the_radius_is_needed():
    a, b = _losing_everything()
    mid, rad = exact_sums.dots_enclosure(a, b, np.float64)
    assert mid[0, 0] == 0.0 and rad[0, 0] > 0
    assert exact_sums_of(a, b)[0, 0] == mpmath.mpf(2) ** -298
    assert not outside(exact_sums_of(a, b), mid, rad)


def test_a_radius_too_small_is_caught(monkeypatch):
    """The check above fails without the bound (a radius of 0)."""
    monkeypatch.setattr(exact_sums, "_radius_factor", lambda K: 0.0)
    a, b = _losing_everything()
    mid, rad = exact_sums.dots_enclosure(a, b, np.float64)
    assert outside(exact_sums_of(a, b), mid, rad)


@pytest.mark.parametrize("dtype", NARROW)
def test_non_finite_operands_leave_their_sums_to_the_oracle(dtype):
    """rad is inf for the sums a non-finite operand enters (inf times 0 included), and only there."""
    a = np.array([[1.0, np.inf], [1.0, 2.0]], dtype=format_of(dtype).dtype)
    b = np.array([[1.0, 0.0], [np.nan, 1.0]], dtype=format_of(dtype).dtype)
    mid, rad = exact_sums.dots_enclosure(a, b, np.float64)
    assert np.isinf(rad).tolist() == [[True, True], [False, True]] and mid[1, 0] == 1.0


def test_float64_operands_are_enclosed_to_long_double_precision():
    """Products of float64 values are not exact in float64: the enclosure is as tight as the exact sums'
    (a unit or two of the working format's last place), not BLAS's gamma_K bound."""
    rng = np.random.default_rng(0)
    for K in (3840, 15360):
        a, b = rng.standard_normal((2, K)), rng.standard_normal((3, K))
        mid, rad = exact_sums.dots_enclosure(a, b, np.longdouble)
        assert (rad <= 2 * np.finfo(np.longdouble).eps * np.abs(mid)).all()
        assert not outside(exact_sums_of(a, b), mid, rad)


@st.composite
def float64_operands(draw):
    """Two rows of a and three of b in float64, where their double-double sums are hardest: entries
    spread over many binades within a row, products near overflow (past the sums' limit, where the
    exact sums take them), products and their errors below float64's normal range, subnormals, sums that
    cancel, an inf; K up to the real 15360."""
    K = draw(st.sampled_from(REAL_DEPTHS) | st.integers(1, 15360))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["spread", "large", "small", "underflow", "subnormal", "cancel", "inf"]))
    a, b = rng.standard_normal((2, K)), rng.standard_normal((3, K))
    if kind == "spread":
        a = a * np.exp2(rng.integers(-80, 80, a.shape))
        b = b * np.exp2(rng.integers(-80, 80, b.shape))
    elif kind == "large":
        a, b = a * 2.0 ** draw(st.integers(400, 1000)), b * 2.0 ** draw(st.integers(-60, 60))
    elif kind == "small":
        a, b = a * 2.0 ** draw(st.integers(-1000, -400)), b * 2.0 ** draw(st.integers(-200, 0))
    elif kind == "underflow":  # products near 2^-1060: their roundings and errors below 2^-1022
        a, b = a * 2.0**-530, b * 2.0 ** -draw(st.integers(500, 545))
    elif kind == "subnormal":
        a, b = a * 2.0**-1074 * 2**20, b
    elif kind == "cancel":
        b[:, 1::2] = b[:, 0::2][:, :K // 2]
        a[:, 1::2] = -a[:, 0::2][:, :K // 2]
        a[:, -1] = a[:, -1] * 2.0**-70
    else:
        b[1, rng.integers(K)] = np.inf
    return a, b


@settings(max_examples=40, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(float64_operands())
def test_float64_dots_enclosure_holds_the_exact_sums(pair):
    a, b = pair
    with np.errstate(all="ignore"):
        mid, rad = exact_sums.dots_enclosure(a, b, np.longdouble)
    exact = exact_sums_of(a, b)
    assert np.isfinite(rad).all() or not np.isfinite(b).all()  # an inf leaves its block to the oracle
    assert not [i for i in outside(exact, mid, rad) if np.isfinite(rad[i])], f"K = {a.shape[-1]}: outside mid ± rad"


def _cancelling_to_the_last_bits():
    """A float64 sum of 40 products spread over 2^120, whose last term undoes all but the exact sum's
    rounding error: the double-double sum keeps about 2^-106 of the terms, which is 2^-53 of what is
    left."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((1, 40)) * np.exp2(rng.integers(-30, 30, (1, 40))) for _ in range(2))
    a[0, -1], b[0, -1] = 0.0, 1.0
    a[0, -1] = -float(exact_sums_of(a, b)[0, 0])
    return a, b


def _underflowing():
    """Products near 2^-1062, rounded to float64's subnormals with their errors lost."""
    rng = np.random.default_rng(1)
    return rng.standard_normal((2, 7)) * 2.0**-530, rng.standard_normal((3, 7)) * 2.0**-532


@pytest.mark.parametrize("operands, term", [(_cancelling_to_the_last_bits, "_double_double_factor"),
                                            (_underflowing, "_UNDERFLOW")])
def test_each_term_of_the_double_double_radius_is_needed(monkeypatch, operands, term):
    """The check above holds with the radius, and fails without the term for the sums' roundings (c = 0)
    or for the products' underflow."""
    a, b = operands()
    mid, rad = exact_sums.dots_enclosure(a, b, np.longdouble)
    assert not outside(exact_sums_of(a, b), mid, rad)
    monkeypatch.setattr(exact_sums, term, (lambda K: 0.0) if term.startswith("_double") else 0.0)
    mid, rad = exact_sums.dots_enclosure(a, b, np.longdouble)
    assert outside(exact_sums_of(a, b), mid, rad)


def test_shared_products_are_computed_once_per_weight_and_operand():
    """Inside ``sharing`` a second call on the same weight and the same values of a returns the
    first's results; another weight, other values of a, or a call outside the block computes afresh, and
    the results are those computed afresh."""
    rng = np.random.default_rng(0)
    W, V = (rng.standard_normal((5, 7)).astype(np.float32) for _ in range(2))
    a = rng.standard_normal((2, 7)).astype(np.float32)
    alone = exact_sums.products(a, W)
    with exact_sums.sharing():
        first = exact_sums.products(a, W)
        assert exact_sums.products(a.astype(np.float64), W) is first  # a's values, whatever its format
        assert exact_sums.products(a + 1, W) is not first
        assert exact_sums.products(a, V) is not first
        assert exact_sums.products(a, W.copy()) is not first
    assert exact_sums.products(a, W) is not first
    for got, want in zip(first, alone):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(alone[0], a.astype(np.float64) @ W.astype(np.float64).T)
    np.testing.assert_array_equal(alone[2], np.abs(W.astype(np.float64)).sum(axis=1))


def test_float64_products_inside_sharing_are_the_enclosures_sums():
    """For float64 operands the error models' products are the enclosure's double-double sums: rounded to
    float64 (the exact sums to within an ULP), the sums of |fl(a b)| and the row sums of |W|, not a
    second pass over W."""
    rng = np.random.default_rng(2)
    a, W = rng.standard_normal((2, 300)), rng.standard_normal((5, 300))
    with exact_sums.sharing():
        key = (W, a.tobytes(), a.shape)
        assert exact_sums.shared("signed products", key) is None
        exact_sums.dots_enclosure(a, W, np.longdouble)
        registered = exact_sums.shared("signed products", key)  # what the enclosure left, not computed here
        assert registered is not None
        assert exact_sums.products(a, W) is registered and exact_sums.products(a, W, signed=False) is registered
        logits, dots, sums = registered
    with mpmath.workprec(128):
        exact = np.array([[float(x) for x in row] for row in exact_sums_of(a, W)])
    assert (np.abs(logits - exact) <= np.spacing(np.abs(exact))).all()
    np.testing.assert_allclose(dots, np.abs(a) @ np.abs(W).T, rtol=1e-13)
    np.testing.assert_allclose(sums, np.abs(W).sum(axis=1), rtol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attentions_logits_are_not_kept(dtype):
    """Attention's enclosure leaves no products in the assessment's shared results: no error model reads
    its logits, which at a real-size prefill are gigabytes a key-value head."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in ((3, 2, 2, 8), (5, 2, 8), (5, 2, 8)))
    with exact_sums.sharing():
        enclosures.causal_gqa(0.5, np.arange(2, 5), q, k, v, work=enclosures.work_type(np.finfo(dtype).nmant + 1))
        assert not [key for key in exact_sums._shared if "products" in key[0]]


def test_unsigned_products_are_not_served_to_a_signed_call_but_signed_ones_to_an_unsigned():
    rng = np.random.default_rng(1)
    W, V, a = rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((2, 4))
    with exact_sums.sharing():
        assert exact_sums.products(a, W, signed=False)[0] is None
        np.testing.assert_array_equal(exact_sums.products(a, W)[0], a @ W.T)
        signed = exact_sums.products(a, V)
        assert exact_sums.products(a, V, signed=False) is signed


def test_shared_results_are_kept_by_the_identity_of_arrays_and_the_value_of_the_rest():
    x, calls = np.ones(3), []

    def compute():
        calls.append(1)
        return len(calls)

    assert exact_sums.shared("f", (x, 2.0), compute) == 1 and exact_sums.shared("f", (x, 2.0), compute) == 2  # outside
    with exact_sums.sharing():
        unhashable = [1]
        assert exact_sums.shared("f", (x, unhashable), compute) == exact_sums.shared("f", (x, unhashable), compute)
        assert exact_sums.shared("f", (x, 2.0), compute) == exact_sums.shared("f", (x, 2.0), compute)
        assert exact_sums.shared("f", (x.copy(), 2.0), compute) != exact_sums.shared("f", (x, 2.0), compute)
        assert exact_sums.shared("f", (x, 3.0), compute) != exact_sums.shared("f", (x, 2.0), compute)
        assert exact_sums.shared("g", (x, 2.0)) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_16_bit_value_widens_exactly(dtype):
    """``widen`` (a compiled loop for bf16 and fp16) gives numpy's and ml_dtypes' float64 for each of the
    65536 bit patterns, signed zeros and infinities included, in any layout."""
    values = np.arange(1 << 16, dtype=np.uint16).view(format_of(dtype).dtype).reshape(64, 1024)
    for x in (values, values[::3, 5::7], values.T, values.reshape(4, 16, 1024)):
        got, want = exact_sums.widen(x), x.astype(np.float64)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_float64_sums_stay_tight_where_a_huge_entry_meets_a_zero():
    """A masked weight against a huge value adds nothing to the radius: the sums stay within 2^-60 of
    themselves."""
    a = np.array([[0.3, 0.7, 0.0], [0.5, 0.0, 0.5]])
    b = np.array([[0.1, 0.2, 2.0**255], [1.0, -1.0, 3.0]])
    mid, rad = exact_sums.dots_enclosure(a, b, np.longdouble)
    exact = exact_sums_of(a, b)
    assert not outside(exact, mid, rad)
    assert (rad <= 2.0**-60 * np.abs(mid)).all(), rad
