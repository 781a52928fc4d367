"""The compiled error models evaluate the formulas their docstrings state: checked against mpmath."""

from __future__ import annotations

import math

import mpmath
import numpy as np

from gemma4_conformance.properties import error_models
from gemma4_conformance.properties.budget import ACCUMULATION, tau
from gemma4_conformance.spec import format_of


def _gelu_steps(x: float, tau_plus_one: float) -> float:
    """g(x) of ``error_models._gelu_absolute``, at 200 bits."""
    with mpmath.workprec(200):
        v = mpmath.mpf(x)
        t = mpmath.mpf(error_models.GELU_K) * (v + mpmath.mpf(0.044715) * v**3)
        return float(abs(v) / 2 * (7 * abs(t) * mpmath.sech(t) ** 2 + tau_plus_one * abs(mpmath.tanh(t)))
                     + 2 * abs(v / (1 + mpmath.exp(-2 * t))))


def test_gelus_allowance_is_its_formula():
    """One exp stands for GELU's sech^2, tanh and the uncancelled product: g(x) within 10^-14 of itself
    from tiny x (where 1 - e^(-2t) cancels) to x past float64's cube root of its range."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(2000) * 10.0 ** rng.uniform(-40, 3, 2000),
                        [0.0, 1e-300, -1e-300, 30.0, -30.0, 1e5, -1e5, 3e38, -3e38]])
    out = np.empty(x.size)
    error_models._gelu_absolute(x, np.zeros(0), 1.0, 3.0, 0.0, out)  # eps_A 1, tiny 0: g(x) itself
    expected = np.array([_gelu_steps(v, 3.0) for v in x])
    np.testing.assert_allclose(out, expected, rtol=1e-14, atol=0)


def test_ropes_scale_and_angle_error_are_their_formula():
    """Per rotated pair: the pair's norm, and u_A |pos w| (2 + TAU + |ln w|) of it; pass-through
    coordinates: |x| and no angle error (rot < D), with Lean's frequencies."""
    rng = np.random.default_rng(1)
    theta, rot, denom, active, D = 1e4, 6, 8, 3, 9
    x = rng.standard_normal((4, 2, D)) * 10.0 ** rng.integers(-20, 20, (4, 2, 1))
    pos = rng.integers(0, 262144, (4, 2))
    scale, absolute = error_models.rope((theta, rot, denom, active, pos, x), None, "bfloat16")
    flush = error_models.product_flush("bfloat16", scale, 1.0) * 2
    freqs = error_models._frequencies(theta, denom, active, rot // 2)
    u_acc = format_of(ACCUMULATION["bfloat16"]).eps
    for index in np.ndindex(pos.shape):
        for k in range(D):
            i = k - rot // 2 if rot // 2 <= k < rot else k
            if i >= rot // 2:  # passed through
                assert scale[index][k] == abs(x[index][k]) and absolute[index][k] == flush[index][k]
                continue
            w = float(freqs[i])
            r = float(mpmath.hypot(x[index][i], x[index][i + rot // 2]))
            error = r * u_acc * abs(float(pos[index]) * w) * (2 + tau("bfloat16") + (abs(math.log(w)) if w else 0.0))
            assert math.isclose(scale[index][k], r, rel_tol=1e-15)
            assert math.isclose(absolute[index][k] - flush[index][k], error, rel_tol=1e-14)


def test_softmaxs_scale_is_its_formula():
    """p (1 + |z| + sum_j p_j |z_j|) over the visible logits, z = s - max, 0 where masked: within 10^-13 of
    itself at 100 bits, row by row, rows with nothing visible (all 0) and one visible logit included."""
    rng = np.random.default_rng(2)
    for L in (1, 3, 17, 300):
        s = rng.standard_normal((4, L)) * rng.choice([0.1, 4.0, 100.0], (4, 1))
        visible = rng.random((4, L)) < 0.7
        visible[0], visible[1, 1:], visible[1, 0] = False, False, True
        exact, _ = error_models.masked_softmax(s, visible)  # the model reads p from the exact result
        scale, absolute = error_models.softmax((s, visible), exact, "bfloat16")
        assert (absolute == np.where(visible, 2 * error_models.tiny("bfloat16"), 0.0)).all()
        for row, seen in zip(range(4), visible):
            with mpmath.workprec(100):
                top = max((mpmath.mpf(v) for v in s[row][seen]), default=mpmath.mpf(0))
                z = [mpmath.mpf(v) - top for v in s[row]]
                e = [mpmath.exp(t) if v else mpmath.mpf(0) for t, v in zip(z, seen)]
                p = [x / sum(e) for x in e] if seen.any() else e
                spread = sum(q * abs(t) for q, t in zip(p, z))
                expected = [float(q * (1 + abs(t) + spread)) if v else 0.0 for q, t, v in zip(p, z, seen)]
            np.testing.assert_allclose(scale[row], expected, rtol=1e-13, atol=0)
