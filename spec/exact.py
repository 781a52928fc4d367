"""Exact inputs and the working precision of the oracles.

Every floating input of any format under test is a dyadic rational that float64 holds exactly, so
it becomes an mpf with no rounding.  The oracles then compute at the working precision (in bits),
which defaults to well above float64 and is set with ``precision(bits)``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable

import numpy as np
from mpmath import mp, mpf

DEFAULT_PRECISION = 128
_precision = DEFAULT_PRECISION


def get_precision() -> int:
    return _precision


@contextlib.contextmanager
def precision(bits: int):
    """Evaluate the oracles inside this block at ``bits`` bits of working precision."""
    global _precision
    if bits < 2:
        raise ValueError(f"working precision must be at least 2 bits, got {bits}")
    saved, _precision = _precision, int(bits)
    try:
        yield
    finally:
        _precision = saved


_to_mpf = np.frompyfunc(lambda t: mpf(float(t)), 1, 1)


def exact(x):
    """An input taken exactly: floating arrays become object arrays of mpf, floating scalars mpf.

    Integer and boolean arrays (positions, tokens, masks), Python ints, None and values that are
    already exact (object arrays, mpf) pass through unchanged.
    """
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "f" or x.dtype.name == "bfloat16":
            return _to_mpf(x.astype(np.float64)).reshape(x.shape).astype(object)
        return x
    if isinstance(x, (float, np.floating)):
        return mpf(float(x))
    return x


def oracle(fn: Callable) -> Callable:
    """Make ``fn`` an oracle: inputs taken exactly, body evaluated at the working precision."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        with mp.workprec(_precision):
            return fn(*(exact(a) for a in bound.args), **{k: exact(v) for k, v in bound.kwargs.items()})

    return wrapper


def elementwise(f: Callable[..., mpf], *arrays):
    """Apply a scalar mpmath function elementwise to object arrays (or scalars), broadcasting."""
    return np.frompyfunc(f, len(arrays), 1)(*arrays)


def rowwise(f: Callable[[np.ndarray], object], x: np.ndarray) -> np.ndarray:
    """Apply ``f`` to each row ``x[..., :]`` (the last axis); returns an object array of shape x.shape[:-1]."""
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty(rows.shape[0], dtype=object)
    for i, row in enumerate(rows):
        out[i] = f(row)
    return out.reshape(x.shape[:-1])


def dot(a, b) -> mpf:
    """sum_k a_k b_k with one rounding at the working precision (mpmath's fdot)."""
    return mp.fdot(list(a), list(b))
