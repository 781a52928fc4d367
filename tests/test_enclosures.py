"""The judging's first stage (spec.enclosures): it encloses the oracle, it gives the oracle's verdicts,
and it is not enough alone; the oracle's own roundings are correct."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import mpmath
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemma4_conformance import adapters, spec
from gemma4_conformance.spec import enclosures, fmt, round_to
from gemma4_conformance.properties.harness import assess, call, correctly_rounded, printed
from gemma4_conformance.properties.strategies import build, cases, edge_cases
from gemma4_conformance.properties.table import OPS

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
    return enclosures.ENCLOSURES[op](*args, work=enclosures.work_type(fmt(dtype).precision))


def assert_encloses(op, args, dtype):
    try:
        mid, rad = enclose(op, args, dtype)
    except enclosures.NotEnclosed:
        return
    mid, rad = np.atleast_1d(mid), np.atleast_1d(rad)
    exact = np.asarray(spec.ORACLES[op](*args), dtype=object).reshape(mid.shape)
    bounded = np.isfinite(rad)
    mid, rad = as_mpf(np.where(bounded, mid, 0)), as_mpf(np.where(bounded, rad, 0))
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


def test_a_wrong_radius_is_caught():
    """The containment check itself fails on an enclosure one unit of its radius too narrow."""
    args = build("softmax", edge_cases("softmax")[0], "float32") if edge_cases("softmax") else None
    mid, rad = enclose("softmax", args, "float32")
    exact = np.asarray(spec.softmax(*args), dtype=object)
    shifted = as_mpf(mid + 2 * rad + 1e-30)
    assert any(abs(e - s) > r for e, s, r in zip(exact.ravel(), shifted.ravel(), as_mpf(rad).ravel()) if r > 0)


def _elementary_cases():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-8, 3, 4000),
                        rng.uniform(-700, 700, 1000), [16.0757, -16.0757, 0.5, 1e-300, 709.7, -745.0]])
    angles = np.concatenate([rng.uniform(0, 262144, 2000), np.arange(1, 400) * np.pi])
    return x, angles


@pytest.mark.parametrize("work", [np.float64, np.longdouble])
def test_elementary_functions_within_the_bound(work):
    """numpy's exp, tanh, sin, cos and pow (float64) and glibc's long double ones err by at most half
    the relative error ELEMENTARY allows, on random arguments and known hard ones (near exp's overflow
    and underflow, tanh near 16, sin and cos at up to 262144 and near multiples of pi)."""
    x, angles = _elementary_cases()
    u = np.finfo(work).eps / 2
    limit = mpmath.mpf(float(enclosures.ELEMENTARY * u / 2))
    x_w, angles_w = x.astype(work), angles.astype(work)
    with mpmath.workprec(160):
        checks = [(np.exp, mpmath.exp, x_w[np.abs(x) < 700]), (np.tanh, mpmath.tanh, x_w),
                  (np.sin, mpmath.sin, angles_w), (np.cos, mpmath.cos, angles_w)]
        base = np.abs(x_w[:500]) + 1
        exponents = -(x_w[:500] / 50)
        worst = {}
        for fn, exact_fn, args in checks:
            got = as_mpf(fn(args))
            worst[fn.__name__] = max(abs(g - exact_fn(a)) / abs(exact_fn(a))
                                     for g, a in zip(got, as_mpf(args)) if exact_fn(a) != 0)
        got = as_mpf(np.power(base, exponents))
        worst["power"] = max(abs(g - mpmath.power(b, e)) / mpmath.power(b, e)
                             for g, b, e in zip(got, as_mpf(base), as_mpf(exponents)))
    assert all(w <= limit for w in worst.values()), {k: float(w / u) for k, w in worst.items()}


def _outputs(op, args, dtype, out):
    """The backend's output and outputs placed on and around the budget's edge and beyond it: the
    correctly rounded result moved by whole ULPs, zeros and the sign flipped."""
    exact = np.asarray(spec.ORACLES[op](*args), dtype=object).reshape(out.shape)
    nearest = round_to(exact, dtype).astype(np.float64)
    f = fmt(dtype)
    spacing = np.where(nearest == 0, f.smallest_subnormal, np.spacing(np.abs(nearest).astype(f.dtype)).astype(float))
    yield out
    for k in (1, 2, 3, 5):
        yield (nearest + k * spacing).astype(f.dtype)
    yield np.zeros_like(out)
    yield (-nearest).astype(f.dtype)


def same_verdict(op, args, dtype, out):
    fast, oracle = assess(op, args, out, dtype), assess(op, args, out, dtype, first_stage=False)
    assert fast.passed == oracle.passed and fast.failures == oracle.failures, (op, dtype, fast.failures, oracle.failures)
    assert fast.admitted == oracle.admitted, (op, dtype)
    assert printed(fast.max_error) == printed(oracle.max_error) or fast.max_error * 0 != 0, \
        (op, dtype, fast.max_error, oracle.max_error)
    if oracle.tier2 is not None:
        assert printed(fast.tier2.error) == printed(oracle.tier2.error), (op, dtype, fast.tier2, oracle.tier2)
    return fast


@pytest.mark.parametrize("op", sorted(spec.OP_NAMES))
def test_first_stage_gives_the_oracles_verdicts(op):
    """On the profile's edge cases and drawn examples, for numpy's output and outputs at whole ULPs
    around the correctly rounded result (which straddle every small budget) and trivially wrong ones,
    both paths give the same verdict, failure messages, informativeness and largest error as printed."""
    adapter = adapters.load("numpy")
    for dtype in DTYPES:
        def judged(case):
            args = build(op, case, dtype)
            for out in _outputs(op, args, dtype, call(adapter, op, args, dtype)):
                same_verdict(op, args, dtype, out)

        for case in edge_cases(op)[:2]:
            judged(case)

        @settings(max_examples=2, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def drawn(data):
            judged(data.draw(cases(op, dtype)))

        drawn()


def _bf16(values):
    return np.asarray(values, dtype=np.float64).astype(ml_dtypes.bfloat16)


def test_without_its_fallback_the_first_stage_passes_a_wrong_inf():
    """bf16's largest value plus (1 - 2^-50) times half its top ULP lies just below the overflow
    threshold: it rounds to the largest value, while its float64 enclosure straddles the threshold.
    An inf there is wrong: the oracle fails it, the enclosure alone cannot and passes it."""
    top = fmt("bfloat16").max_finite
    args = (1 - 2.0**-50, _bf16([top]), _bf16([2.0**119]))
    out = _bf16([np.inf])
    assert not assess("residual", args, out, "bfloat16").passed
    assert not assess("residual", args, out, "bfloat16", first_stage=False).passed
    assert assess("residual", args, out, "bfloat16", fallback=False).passed


def _exactly(value: Fraction, dtype) -> float:
    """A rational rounded once to ``dtype``: as an mpf of enough bits to hold it, which round_to rounds."""
    bits = max(value.numerator.bit_length(), value.denominator.bit_length()) + 64
    with mpmath.workprec(bits):
        return float(round_to(mpmath.mpf(value.numerator) / value.denominator, dtype))


def test_oracle_rounds_once_linear():
    """The issue's case: 257 + 2^-120 rounds to 258 in bf16; rounded to 128 bits first, it tied to 256."""
    x, W = np.array([256.0, 1.0, 2.0**-120]), np.array([[1.0, 1.0, 1.0]])
    exact = Fraction(256) + 1 + Fraction(1, 2**120)
    want = _exactly(exact, "bfloat16")
    assert want == 258.0
    for first_stage in (True, False):  # 254 is 1.5 ULPs off, past the budget of one rounding
        verdict = assess("linear", (_bf16(W), _bf16(x)), _bf16([254.0]), "bfloat16", first_stage=first_stage)
        assert not verdict.passed and "258.0" in verdict.failures[0].split("correctly rounded")[1][:25]


@pytest.mark.parametrize("op", ["silu", "gelu_tanh"])
def test_oracle_rounds_once_at_the_smallest_subnormal(op):
    """silu and GELU of bf16's smallest subnormal s lie just above s / 2 (their slope at 0 is 1/2), so
    they round up to s; at 128 bits they were s / 2 exactly and tied to 0."""
    s = fmt("bfloat16").smallest_subnormal
    exact = np.asarray(spec.ORACLES[op](_bf16([s])), dtype=object)
    _, rounded = correctly_rounded(OPS[op].oracle, (_bf16([s]),), exact, "bfloat16")
    assert float(rounded[0]) == s


def _example(op):
    drawn = []

    @quick
    @given(cases(op, "float32"))
    def keep(case):
        drawn.append(case)

    keep()
    return max(drawn, key=lambda case: str(case))


def test_restrictions_hold_the_masked_elements():
    """Each op's restriction keeps every masked element, at the position its index names."""
    rng = np.random.default_rng(1)
    for op in ENCLOSED:
        entry = OPS[op]
        args = build(op, (edge_cases(op) or [None])[0] or _example(op), "float32")
        shape = spec.CONTRACT[op].output_shape(*args)
        mask = rng.random(shape) < 0.05
        mask.flat[rng.integers(mask.size)] = True
        part, where = entry.restrict(op, args, mask)
        marker = np.zeros(shape, dtype=bool)
        marker[where] = True
        assert marker[mask].all(), op
        assert spec.CONTRACT[op].output_shape(*part) == np.zeros(shape)[where].shape, op
