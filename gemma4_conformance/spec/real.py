"""Mathlib's real operations where mpmath's differ: Lean's are total, so the oracles are defined on
every input a case can hold (eps = 0 over a zero row, denom = 0, c = 0) and give Lean's value there.

Each takes mpf scalars; ``elementwise`` applies them to arrays.
"""

from mpmath import mp


def div(a, b):
    """``a / b`` over ℝ: ``a / 0 = 0`` (``div_zero``)."""
    return a / b if b else mp.zero


def sqrt(a):
    """``Real.sqrt a``: 0 for ``a < 0`` (``Real.sqrt_eq_zero_of_nonpos``), not mpmath's imaginary root."""
    return mp.sqrt(a) if a > 0 else mp.zero


def rpow(x, y):
    """``x ^ y`` for real ``x, y`` (``Real.rpow``): ``x ^ 0 = 1`` (``Real.rpow_zero``); ``0 ^ y = 0``
    for ``y ≠ 0`` (``Real.zero_rpow``); ``x ^ y = exp (log x * y) * cos (y * π)`` for ``x < 0``
    (``Real.rpow_def_of_neg``, ``Real.log x = log |x|``), where mpmath's power is complex."""
    if y == 0:
        return mp.one
    if x == 0:
        return mp.zero
    if x < 0:
        return mp.power(-x, y) * mp.cospi(y)  # cos (y * π), exact where y is an integer or a half
    return mp.power(x, y)
