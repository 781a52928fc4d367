"""Rope.lean: rotate-half RoPE with pairs (i, i + rot/2) and inverse frequencies theta^(-2i/denom)."""

import numpy as np
from mpmath import mp

from . import real
from .exact import elementwise, oracle


@oracle
def inv_freq(theta, denom, active, i):
    """``invFreq theta denom active i := if i < active then theta ^ (-(2 * (i : ℝ) / denom)) else 0``

    ``i`` is an integer or an integer array; the result has its shape.  Division and power are Lean's
    (``real``): denom = 0 gives ``theta ^ (-0) = 1``.
    """
    return elementwise(lambda j: real.rpow(theta, -real.div(2 * mp.mpf(int(j)), denom)) if j < active else mp.zero,
                       np.asarray(i, dtype=object))


@oracle
def rope(theta, rot, denom, active, pos, x):
    """``rope theta rot denom active pos x``: ``x [..., D]``, ``pos`` integer ``[...]``.

    .. code-block:: lean

        fun t d =>
          let half := rot / 2
          if d.val < half then
            let a := (pos t : ℝ) * invFreq theta denom active d.val
            x t d * Real.cos a - (if h : d.val + half < D then x t ⟨d.val + half, h⟩ else 0) * Real.sin a
          else if d.val < 2 * half then
            let a := (pos t : ℝ) * invFreq theta denom active (d.val - half)
            x t d * Real.cos a + x t ⟨d.val - half, by omega⟩ * Real.sin a
          else x t d
    """
    pos = np.asarray(pos, dtype=object)
    out = np.empty_like(x)
    # The angle pos * w must be known to |a| 2^-p absolutely: guard bits for the size of pos.
    guard = max((int(p).bit_length() for p in pos.ravel()), default=0) + 8
    with mp.workprec(mp.prec + guard):
        _rotate(theta, rot, denom, active, pos, x, out)
    return out


def _rotate(theta, rot, denom, active, pos, x, out):
    """The body of ``rope``, writing into ``out``."""
    D = x.shape[-1]
    half = rot // 2
    # Each angle once per distinct position (the heads of a token share theirs).
    distinct, where = np.unique(pos.astype(np.int64), return_inverse=True)
    distinct = distinct.astype(object)
    for d in range(D):
        if d < half:
            cos, sin = _cos_sin(distinct * inv_freq(theta, denom, active, d), where, pos.shape)
            partner = x[..., d + half] if d + half < D else 0
            out[..., d] = x[..., d] * cos - partner * sin
        elif d < 2 * half:
            cos, sin = _cos_sin(distinct * inv_freq(theta, denom, active, d - half), where, pos.shape)
            out[..., d] = x[..., d] * cos + x[..., d - half] * sin
        else:
            out[..., d] = x[..., d]


def _cos_sin(a, where, shape):
    """cos and sin of the angles ``a``, spread back to ``shape`` by the index ``where``."""
    return (elementwise(f, a)[where].reshape(shape) for f in (mp.cos, mp.sin))


@oracle
def rope_std(theta, rot, pos, x):
    """``ropeStd theta rot pos x := rope theta rot rot (rot / 2) pos x``"""
    return rope(theta, rot, rot, rot // 2, pos, x)
