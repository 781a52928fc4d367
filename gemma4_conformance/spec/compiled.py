"""The enclosures of ``spec.enclosures`` in float64, compiled: one loop per element (numba).

Each kernel evaluates its enclosure's formula (derived beside it in ``spec.enclosures``) with the same
operations in the same order, on flat float64 arrays, and returns ``(mid, rad)``.  numba compiles
with IEEE semantics: no fastmath, so no reassociation and no contraction into fused multiply-adds
the bounds do not state; ``error_model="numpy"``, so a division by zero gives inf or nan as numpy's
does.  exp and tanh are LLVM's intrinsics, which call the C library's (tests/test_enclosures.py
measures them against mpmath, as it does numpy's).  Compiled code is cached beside this file, or,
where the package's folder is read-only (an installed wheel), in numba's per-user cache folder
(``NUMBA_CACHE_DIR`` overrides both).
"""

from __future__ import annotations

import math

import numba
import numpy as np

jit = numba.njit(cache=True, error_model="numpy")

U = 2.0**-53  # float64's unit roundoff
TINY = 2.0**-1022  # its smallest normal number


def constants(elementary: float, margin: float):
    """(E, MARGIN) of ``spec.enclosures`` for float64: E = ELEMENTARY u."""
    return elementary * U, margin


@jit
def _rad(mid, relative, absolute, margin):
    """relative |mid| + absolute, with the margin; inf where mid is not finite."""
    if not math.isfinite(mid):
        return math.inf
    return (relative * abs(mid) + absolute) * margin


@jit
def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


@jit
def sigmoid(x, E, margin):
    mid, rad = np.empty(x.size), np.empty(x.size)
    for i in range(x.size):
        y = _sigmoid(x[i])
        mid[i], rad[i] = y, _rad(y, E + 2 * U, 2 * TINY, margin)
    return mid, rad


@jit
def silu(x, E, margin):
    mid, rad = np.empty(x.size), np.empty(x.size)
    for i in range(x.size):
        y = x[i] * _sigmoid(x[i])
        mid[i], rad[i] = y, _rad(y, E + 2 * U + U, 2 * TINY * (1 + abs(x[i])), margin)
    return mid, rad


@jit
def _gelu(x, k, a, E):
    """(y, relative, absolute) of ``spec.enclosures._gelu`` for one x."""
    t = -2 * k * (x + a * (x * x * x))
    e = math.exp(t)
    y = x / (1 + e)
    passed = e / (1 + e) if math.isfinite(e) else 1.0
    rel = 2 * U + passed * (E + 7 * U * (abs(t) if math.isfinite(t) else 0.0))
    return y, rel, 2 * TINY * (1 + abs(x))


@jit
def gelu_tanh(x, k, a, E, margin):
    mid, rad = np.empty(x.size), np.empty(x.size)
    for i in range(x.size):
        y, rel, absolute = _gelu(x[i], k, a, E)
        mid[i], rad[i] = y, _rad(y, rel, absolute, margin)
    return mid, rad


@jit
def softcap(c, x, E, margin):
    mid, rad = np.empty(x.size), np.empty(x.size)
    for i in range(x.size):
        y = c * math.tanh(x[i] / c)
        mid[i], rad[i] = y, _rad(y, E + 3 * U, 2 * TINY * (1 + abs(c)), margin)
    return mid, rad


@jit
def silu_mul(gate, up, E, margin):
    mid, rad = np.empty(gate.size), np.empty(gate.size)
    for i in range(gate.size):
        g = gate[i]
        y = g * _sigmoid(g) * up[i]
        mid[i], rad[i] = y, _rad(y, E + 2 * U + 2 * U, 2 * TINY * (1 + abs(g)) * abs(up[i]), margin)
    return mid, rad


@jit
def gelu_mul(gate, up, k, a, E, margin):
    mid, rad = np.empty(gate.size), np.empty(gate.size)
    for i in range(gate.size):
        g, rel, absolute = _gelu(gate[i], k, a, E)
        y = g * up[i]
        mid[i], rad[i] = y, _rad(y, rel + U, absolute * abs(up[i]), margin)
    return mid, rad


@jit
def residual(r, x, h, margin):
    mid, rad = np.empty(x.size), np.empty(x.size)
    for i in range(x.size):
        product = r * h[i]
        y = x[i] + product
        mid[i], rad[i] = y, _rad(y, U, U * abs(product) * 2 + 2 * TINY, margin)
    return mid, rad


@jit
def scaled(c, x, margin):
    """c x, one rounding (embed's rows)."""
    mid, rad = np.empty(x.size), np.empty(x.size)
    for i in range(x.size):
        y = c * x[i]
        mid[i], rad[i] = y, _rad(y, U, 2 * TINY, margin)
    return mid, rad


@jit
def sigmoid_gate(o, gate, E, margin):
    mid, rad = np.empty(o.size), np.empty(o.size)
    for i in range(o.size):
        y = o[i] * _sigmoid(gate[i])
        mid[i], rad[i] = y, _rad(y, E + 2 * U + U, 2 * TINY * (1 + abs(o[i])), margin)
    return mid, rad
