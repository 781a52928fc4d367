"""The oracles' exact sums (spec.exact.dots, sums_of_squares) agree bit for bit with the definition,
``dot``: the exact sum of the exact products, rounded once to the working precision.

The inputs are those that break a shortcut: exponents spread over the whole float64 range,
subnormals of every format, sums cancelling to exactly 0, signed zeros, long one-signed sums, operands
of different formats, mpf operands with 128-bit mantissas, and infinities.
"""

from __future__ import annotations

import importlib

import ml_dtypes
import numpy as np
import pytest
from mpmath import mp, mpf
from mpmath.libmp import mpf_mul, mpf_pos

from gemma4_conformance import spec
from gemma4_conformance.spec import FORMATS, precision

exact_sums = importlib.import_module("gemma4_conformance.spec.exact")  # spec.exact is also a function's name


def by_definition(a, b, scale=None, rounded=True):
    """scale * sum_k a[..., k] b[n, k] term by term with ``dot``, as the oracles computed it before ``dots``."""
    A = spec.exact(a) if a.dtype != object else a
    B = spec.exact(b) if b.dtype != object else b
    rows = A.reshape(int(np.prod(A.shape[:-1])), A.shape[-1])
    factor = mpf(1 if scale is None else scale)._mpf_
    out = np.empty((rows.shape[0], B.shape[0]), dtype=object)
    for t, row in enumerate(rows):
        for n, col in enumerate(B):
            value = mpf_mul(factor, exact_sums.dot(list(row), list(col), rounded=False)._mpf_)
            out[t, n] = mp.make_mpf(mpf_pos(value, mp.prec, "n") if rounded else value)
    return out.reshape(a.shape[:-1] + (b.shape[0],))


def assert_bit_identical(got, want):
    got, want = np.asarray(got, dtype=object), np.asarray(want, dtype=object)
    assert got.shape == want.shape
    differ = [(i, g, w) for i, (g, w) in enumerate(zip(got.ravel(), want.ravel())) if g._mpf_ != w._mpf_]
    assert not differ, f"{len(differ)} of {got.size} differ, first {differ[0]}"


def in_format(x, name):
    return x.astype(FORMATS[name].dtype).astype(np.float64)


def specials(name):
    """+-0, +-the smallest subnormal and normal, the largest finite value, 1 and 3 of a format."""
    f = FORMATS[name]
    return np.array([0.0, -0.0, f.smallest_subnormal, -f.smallest_subnormal, 2.0**f.emin, -(2.0**f.emin),
                     f.max_finite, -f.max_finite, 1.0, 3.0])


def families(rng):
    """(name, a, b): operands a [R, K], b [N, K] of every kind the oracles meet."""
    normal = rng.standard_normal
    out = [(f"normal {name}", in_format(normal((3, 64)), name), in_format(normal((5, 64)), name))
           for name in FORMATS]
    out += [(f"specials of {name}", rng.choice(specials(name), (3, 40)), rng.choice(specials(name), (4, 40)))
            for name in FORMATS]
    out += [
        ("exponents over the float64 range", normal((3, 50)) * 2.0 ** rng.integers(-1074, 970, (3, 50)),
         normal((4, 50)) * 2.0 ** rng.integers(-1074, 970, (4, 50))),
        ("bf16 against f32", in_format(normal((3, 300)), "bfloat16"), in_format(normal((6, 300)), "float32")),
        ("f16 subnormals against f64", in_format(normal((2, 30)) * 2.0**-20, "float16"), normal((3, 30)) * 1e300),
        ("long one-signed sums", in_format(rng.uniform(0.5, 1.5, (2, 4096)), "bfloat16"),
         in_format(rng.uniform(0.5, 1.5, (3, 4096)), "bfloat16")),
        ("real-size K", in_format(normal((1, 15360)), "float32"), in_format(normal((2, 15360)), "float32")),
        ("zeros", np.zeros((2, 7)), normal((3, 7))),
        ("signed zeros", np.array([[0.0, -0.0], [-0.0, -0.0]]), np.array([[-0.0, 0.0], [-0.0, -0.0]])),
        ("no terms", np.zeros((2, 0)), np.zeros((3, 0))),
        ("one term", np.array([[3.0], [-2.0**-1074]]), np.array([[2.0**-1074], [1e308]])),
    ]
    # Cancellation to exactly 0, and to a tiny remainder below huge terms (row 0 against row 0).
    x = in_format(normal((1, 33)), "float32")
    out.append(("cancels to exactly 0", np.concatenate([x, x], 1), np.concatenate([x, -x], 1)))
    out.append(("cancels to a subnormal", np.array([[1e300, 2.0**-1074, -1e300]]), np.array([[1e10, 3.0, 1e10]])))
    return out


FAMILIES = families(np.random.default_rng(0))


@pytest.mark.parametrize("name, a, b", FAMILIES, ids=[f[0] for f in FAMILIES])
@pytest.mark.parametrize("bits", [53, 128])
def test_dots_are_bit_identical_to_the_definition(name, a, b, bits):
    with precision(bits), mp.workprec(bits):
        assert_bit_identical(exact_sums.dots(a, b), by_definition(a, b))
        assert_bit_identical(exact_sums.dots(a, b, rounded=False), by_definition(a, b, rounded=False))
        assert_bit_identical(exact_sums.dots(a, b, scale=0.1), by_definition(a, b, scale=0.1))
        assert_bit_identical(exact_sums.dots(a, b, scale=-3.0, rounded=False),
                             by_definition(a, b, scale=-3.0, rounded=False))


def test_exact_cancellation_gives_exactly_zero_and_unrounded_sums_keep_every_bit():
    a, b = np.array([[1e300, 2.0**-1074, -1e300]]), np.array([[1.0, 1.0, 1.0]])
    assert exact_sums.dots(a, b, rounded=False)[0, 0] == mpf(2.0**-1074)
    x = in_format(np.random.default_rng(1).standard_normal((1, 99)), "bfloat16")
    assert exact_sums.dots(np.concatenate([x, x], 1), np.concatenate([x, -x], 1))[0, 0] == 0


def test_mpf_operands_with_128_bit_mantissas_and_mixed_operands():
    rng = np.random.default_rng(2)
    with mp.workprec(128):
        p = np.array([[mp.exp(mpf(-3 * i - t)) / 7 for i in range(60)] for t in range(3)], dtype=object)
        p[1, ::3] = mp.zero
    v = in_format(rng.standard_normal((5, 60)), "bfloat16")
    with mp.workprec(128):
        assert_bit_identical(exact_sums.dots(p, v), by_definition(p, v))
        assert_bit_identical(exact_sums.dots(p, spec.exact(v)), by_definition(p, v))
        assert_bit_identical(exact_sums.dots(p, p), by_definition(p, p))


def far_spread_weights(rng, rows, K, nats):
    """Softmax-like mpf rows: the largest 1/3, the rest spread down to about e^-nats (2^-1.44 nats)."""
    with mp.workprec(128):
        logits = -np.sort(rng.uniform(0, nats, (rows, K)))
        logits[:, 0] = 0
        return np.array([[mp.exp(mpf(float(x))) / 3 for x in row] for row in logits], dtype=object)


@pytest.mark.parametrize("bits", [53, 128])
def test_mpf_rows_spanning_far_below_their_largest_are_alike_and_banded_over_their_visible_bits(bits):
    """Weights down to 2^-100000 below each row's largest (attention over logits 7e4 apart): the bits
    a once-rounded sum cannot see are dropped before banding, and every sum stays bit-identical."""
    rng = np.random.default_rng(7)
    p = far_spread_weights(rng, 4, 40, nats=7e4)
    v = in_format(rng.standard_normal((6, 40)), "bfloat16")
    with precision(bits), mp.workprec(bits):
        assert_bit_identical(exact_sums.dots(p, v), by_definition(p, v))
        assert_bit_identical(exact_sums.dots(p, v, scale=-0.1), by_definition(p, v, scale=-0.1))
        assert_bit_identical(exact_sums.dots(p, spec.exact(v)), by_definition(p, v))
        assert_bit_identical(exact_sums.dots(p, v, rounded=False), by_definition(p, v, rounded=False))
        keep = bits + exact_sums._GUARD + 40 .bit_length()
        kept, floors = exact_sums._truncated(p, keep)
        assert all(f is not None for f in floors)
        assert max(grid.span for grid in exact_sums._grids(kept)) <= keep + 2  # not 1e5 bits


@pytest.mark.parametrize("name, row, col", [
    # the kept bits of the sum cancel to 0: what is left is the dropped part
    ("cancelled", [1, 1, mpf(2)**-400, mpf(2)**-401], [1.0, -1.0, 3.0, 1.0]),
    # the kept bits are a tie at 53 bits, which the dropped bits break away from the even neighbour
    ("tie broken up", [1.0, 2.0**-53, mpf(2)**-400], [1.0, 1.0, 1.0]),
    ("tie broken down", [1.0 + 2.0**-52, 2.0**-53, mpf(2)**-400], [1.0, 1.0, -1.0]),
])
def test_sums_whose_rounding_the_dropped_bits_decide_are_summed_by_the_definition(name, row, col):
    with precision(53), mp.workprec(53):
        a = np.array([[mpf(x) for x in row]], dtype=object)
        b = np.array([col])
        assert exact_sums._truncated(a, 53 + exact_sums._GUARD + 3)[1] != [None]
        assert_bit_identical(exact_sums.dots(a, b), by_definition(a, b))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # exact() of a NaN
def test_infinities_and_nan_follow_the_definition():
    a = np.array([[1.0, np.inf], [2.0, 3.0]])
    b = np.array([[1.0, 2.0], [1.0, -0.0], [np.nan, 1.0]])
    got, want = exact_sums.dots(a, b), by_definition(a, b)
    assert [str(g) for g in got.ravel()] == [str(w) for w in want.ravel()]


@pytest.mark.parametrize("name, a, b", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_sums_of_squares_are_bit_identical_to_the_definition(name, a, b):
    with mp.workprec(128):
        got = exact_sums.sums_of_squares(a)
        want = [exact_sums.dot(list(row), list(row)) for row in spec.exact(a)]
        assert_bit_identical(got, np.array(want, dtype=object).reshape(got.shape))


def test_leading_axes_are_kept():
    x = np.random.default_rng(3).standard_normal((2, 3, 8))
    W = np.random.default_rng(4).standard_normal((5, 8))
    assert exact_sums.dots(x, W).shape == (2, 3, 5)
    assert exact_sums.sums_of_squares(x).shape == (2, 3)
    assert exact_sums.sums_of_squares(x[0, 0]).shape == ()


# The oracles built on them: the same values as their term-by-term reading --------------------------------

def test_linear_oracle_takes_summed_floats_and_mpf_alike():
    rng = np.random.default_rng(5)
    W, x = in_format(rng.standard_normal((7, 96)), "bfloat16"), in_format(rng.standard_normal((2, 3, 96)), "bfloat16")
    with mp.workprec(spec.DEFAULT_PRECISION):
        want = by_definition(x, W)
    assert_bit_identical(spec.linear(W.astype(ml_dtypes.bfloat16), x.astype(ml_dtypes.bfloat16)), want)
    assert_bit_identical(spec.linear(spec.exact(W), spec.exact(x)), want)


def attention_by_definition(scale, visible, q, k, v):
    """causal/sliding GQA term by term: exact logits, softmax per query head, then dot per output."""
    S, Hkv, G, D = q.shape
    out = np.empty(q.shape, dtype=object)
    Q, K, V = spec.exact(q), spec.exact(k), spec.exact(v)
    with mp.workprec(spec.DEFAULT_PRECISION):
        for s in range(S):
            for c in range(Hkv):
                for g in range(G):
                    logit = np.array([mp.make_mpf(mpf_mul(mpf(scale)._mpf_, exact_sums.dot(
                        list(Q[s, c, g]), list(K[l, c]), rounded=False)._mpf_)) for l in range(k.shape[0])],
                        dtype=object)
                    p = list(spec.softmax(logit, visible[s]))
                    for d in range(D):
                        out[s, c, g, d] = exact_sums.dot(p, list(V[:, c, d]))
    return out


def test_attention_oracles_keep_exact_logits_and_match_their_term_by_term_reading():
    rng = np.random.default_rng(6)
    S, Hkv, G, D, L = 3, 2, 2, 8, 9
    q = in_format(rng.standard_normal((S, Hkv, G, D)) * 4, "float32")
    k, v = in_format(rng.standard_normal((L, Hkv, D)) * 4, "float32"), in_format(rng.standard_normal((L, Hkv, D)), "float32")
    pos, window = np.array([2, 5, 8]), 3
    keys = np.arange(L)[None, :]
    causal = keys <= pos[:, None]
    assert_bit_identical(spec.causal_gqa(0.3, pos, q, k, v), attention_by_definition(0.3, causal, q, k, v))
    sliding = causal & (pos[:, None] < keys + window)
    assert_bit_identical(spec.sliding_gqa(0.3, window, pos, q, k, v), attention_by_definition(0.3, sliding, q, k, v))
    last = np.ones((1, L), dtype=bool)
    assert_bit_identical(spec.decode_gqa(0.3, q[0], k, v), attention_by_definition(0.3, last, q[:1], k, v)[0])


def test_attention_over_logits_far_apart_matches_its_term_by_term_reading():
    """A default run's draw that sat for minutes: 255 keys with logits tens of thousands apart, whose
    weights span 77000 bits (the keys here ramp down to -8e5)."""
    rng = np.random.default_rng(8)
    S, Hkv, G, D, L = 2, 1, 2, 8, 255
    q = np.full((S, Hkv, G, D), 16.0) * rng.choice([1.0, 0.5], (S, Hkv, G, D))
    k = in_format(-25.0 * np.arange(L)[:, None, None] + rng.standard_normal((L, Hkv, D)), "bfloat16")
    v = in_format(rng.standard_normal((L, Hkv, D)), "bfloat16")
    pos = np.array([200, 254])
    causal = np.arange(L)[None, :] <= pos[:, None]
    assert_bit_identical(spec.causal_gqa(1.0, pos, q, k, v), attention_by_definition(1.0, causal, q, k, v))


@pytest.mark.parametrize("seed", range(3))
def test_digits_hold_any_sum_of_shifted_int64_parts_exactly(seed):
    """The exact sums' accumulator: int64 parts of both signs (up to 2^63 in magnitude) at shifts from 0
    to thousands of bits, many at one shift, carries through every digit, totals of either sign, and
    totals cancelling to exactly 0, against the same sums in Python integers."""
    rng = np.random.default_rng(seed)
    outputs = 64
    digits, cancelled = exact_sums._Digits(outputs), exact_sums._Digits(outputs)
    want = [0] * outputs
    for _ in range(200):
        shift = int(rng.choice([0, 1, 31, 32, 33, 63, 64, 65]) + rng.integers(0, 3) * int(rng.choice([1, 32, 1000])))
        part = rng.integers(-(2**63), 2**63 - 1, outputs, dtype=np.int64, endpoint=True)
        part[rng.random(outputs) < 0.2] = rng.choice([0, -1, 1, -(2**63), 2**63 - 1])
        digits.add(part, shift)
        want = [w + int(p) * 2**shift for w, p in zip(want, part)]
        cancelled.add(part, shift)
        cancelled.add(-(part // 2), shift + 1)  # -(p // 2) 2^(s+1) - (p mod 2) 2^s = -p 2^s
        cancelled.add(-(part % 2), shift)
    got, exponent = digits.integers()
    assert [g * 2**exponent for g in got] == want
    assert any(w < 0 for w in want) and any(w > 0 for w in want)
    assert list(cancelled.integers()[0]) == [0] * outputs
    assert list(exact_sums._Digits(3).integers()[0]) == [0, 0, 0]


def test_the_judges_products_run_blas_on_one_thread_and_leave_it_as_it_was():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from gemma4_conformance.spec.exact import one_blas_thread

    def blas_threads():
        return [pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"]

    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        assert set(blas_threads()) == {2}
        with one_blas_thread():
            assert set(blas_threads()) == {1}
            with one_blas_thread():
                assert set(blas_threads()) == {1}
            assert set(blas_threads()) == {1}  # the inner block leaves the outer's limit
        assert set(blas_threads()) == {2}
