"""The judging's first stage gives the oracle's verdicts, and is not enough alone; the oracle's own
roundings are correct (issue: the judge at the speed of float64)."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import mpmath
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemma4_conformance import adapters, spec
from gemma4_conformance.adapters.contract import call
from gemma4_conformance.properties import judging
from gemma4_conformance.properties.judging import assess, correctly_rounded, printed
from gemma4_conformance.properties.table import OPS, build, cases, edge_cases, real_size_cases
from gemma4_conformance.spec import format_of, round_to
from gemma4_conformance.spec.exact import sharing

DTYPES = ("bfloat16", "float16", "float32", "float64")


def _outputs(op, args, dtype, out):
    """The backend's output and outputs placed on and around the budget's edge and beyond it: the
    correctly rounded result moved by whole ULPs, zeros and the sign flipped."""
    exact = np.asarray(spec.ORACLES[op](*args), dtype=object).reshape(out.shape)
    nearest = round_to(exact, dtype).astype(np.float64)
    f = format_of(dtype)
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
    assert printed(fast.max_error) == printed(oracle.max_error), \
        (op, dtype, fast.max_error, oracle.max_error)
    if oracle.tier2 is not None:
        assert printed(fast.tier2.error) == printed(oracle.tier2.error), (op, dtype, fast.tier2, oracle.tier2)
    return fast


def each_output(op, dtype, check, fixed, examples):
    """``check(args, out)`` on the ``fixed`` cases and ``examples`` drawn ones, for numpy's output and
    ``_outputs``' others."""
    adapter = adapters.load("numpy")

    def judged(case):
        args = build(op, case, dtype)
        for out in _outputs(op, args, dtype, call(adapter, op, args, dtype)):
            check(args, out)

    for case in fixed:
        judged(case)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def drawn(data):
        judged(data.draw(cases(op, dtype)))

    drawn()


@pytest.mark.parametrize("op", sorted(spec.OP_NAMES))
def test_first_stage_gives_the_oracles_verdicts(op):
    """On the profile's edge cases and drawn examples, for numpy's output and outputs at whole ULPs
    around the correctly rounded result (which straddle every small budget) and trivially wrong ones,
    both paths give the same verdict, failure messages, informativeness and largest error as printed."""
    for dtype in DTYPES:
        each_output(op, dtype, lambda args, out: same_verdict(op, args, dtype, out), edge_cases(op)[:2], 2)


def _bf16(values):
    return np.asarray(values, dtype=np.float64).astype(ml_dtypes.bfloat16)


def test_without_its_fallback_the_first_stage_passes_a_wrong_inf():
    """bf16's largest value plus (1 - 2^-50) times half its top ULP lies just below the overflow
    threshold: it rounds to the largest value, while its float64 enclosure straddles the threshold.
    An inf there is wrong: the oracle fails it, the enclosure alone cannot and passes it."""
    top = format_of("bfloat16").max_finite
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
    s = format_of("bfloat16").smallest_subnormal
    exact = np.asarray(spec.ORACLES[op](_bf16([s])), dtype=object)
    _, rounded = correctly_rounded(OPS[op].oracle, (_bf16([s]),), exact, "bfloat16")
    assert float(rounded[0]) == s


ROW_WISE = sorted(name for name, entry in OPS.items() if entry.row_wise and entry.enclosure is not None)


@pytest.mark.parametrize("op", ROW_WISE)
def test_blocks_give_the_whole_outputs_verdict(op, monkeypatch):
    """A row-wise op judged a block of rows at a time (``judging._judged_in_blocks``, here a row a block,
    so that every example of two rows or more has several) gives the verdict of the whole output's arrays,
    every element's error the same number, wherever it gives one; and it gives one on some cases."""
    monkeypatch.setattr(judging, "BLOCK", 1)
    entry, taken = OPS[op], 0
    for dtype in DTYPES[:3]:
        def check(args, out):
            nonlocal taken
            got = np.asarray(out)
            with sharing():
                blocks = judging._judged_in_blocks(entry, args, got, dtype)
                whole, undecided = judging._judge(entry, args, got, dtype, (Ellipsis,),
                                                  judging._enclosed(entry, args, dtype, got))
            if blocks is None:
                return
            taken += 1
            assert whole.passed and not undecided.any() and not whole.contenders.any(), (op, dtype)
            assert blocks.admitted == whole.admitted and blocks.budget == whole.budget, (op, dtype)
            np.testing.assert_array_equal(blocks.errors, whole.errors)

        each_output(op, dtype, check, edge_cases(op)[:2] + real_size_cases(op)[:1], 3)
    assert taken, op
