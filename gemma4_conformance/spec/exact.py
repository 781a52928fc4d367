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
from mpmath.libmp import mpf_mul, mpf_pos, mpf_sum

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
    if is_floating(x):
        return _to_mpf(x.astype(np.float64)).reshape(x.shape).astype(object)
    if isinstance(x, (float, np.floating)):
        return mpf(float(x))
    return x


def is_floating(x) -> bool:
    return isinstance(x, np.ndarray) and (x.dtype.kind == "f" or x.dtype.name == "bfloat16")


def widen(x):
    """Floating arrays of any format under test as float64, which holds them exactly."""
    return x.astype(np.float64) if is_floating(x) else x


_depth = 0  # how many oracles are running: the outermost sets the precision, the others inherit it


def oracle(fn: Callable) -> Callable:
    """Make ``fn`` an oracle: inputs taken exactly, body evaluated at the working precision.

    An oracle called from another runs at its caller's precision, so a composite can raise it for
    a part that needs guard bits (rope's angles).
    """
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _depth
        bound = signature.bind(*args, **kwargs)
        args = tuple(exact(a) for a in bound.args)
        kwargs = {k: exact(v) for k, v in bound.kwargs.items()}
        with mp.workprec(_precision if _depth == 0 else mp.prec):
            _depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                _depth -= 1

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


def dot(a, b, rounded: bool = True) -> mpf:
    """sum_k a_k b_k, exactly (products and sum in integers), then rounded once to the working
    precision; ``rounded=False`` keeps the exact value.  (mpmath's fdot drops terms more than about
    2p bits below the running sum, so it is not used.)"""
    total = mpf_sum([mpf_mul(x._mpf_, y._mpf_) for x, y in zip(a, b)])
    return mp.make_mpf(mpf_pos(total, mp.prec, "n") if rounded else total)
