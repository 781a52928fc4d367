"""Norm.lean: normalisations over the last axis; rows are the leading axes (the Lean index type ι).

Division and square root are Lean's (``real``): a row whose ``Real.sqrt`` is of 0 or less (eps <= 0)
normalises to 0, as ``x / 0 = 0``.
"""

import numpy as np
from mpmath import mp

from . import real
from .basic import silu
from .exact import elementwise, oracle, sums_of_squares


def _per_row(f, x):
    """``f`` of each row's exact sum of squares ``∑ j, x t j ^ 2``: an array of shape ``x.shape[:-1]``."""
    return np.asarray(elementwise(f, sums_of_squares(x)), dtype=object)


@oracle
def rms(eps, x):
    """``rms (eps : ℝ) (x : Fin H → ℝ) : ℝ := Real.sqrt ((∑ j, x j ^ 2) / (H : ℝ) + eps)``

    ``x [..., H]`` -> ``[...]``.
    """
    H = x.shape[-1]
    return _per_row(lambda squares: real.sqrt(real.div(squares, H) + eps), x)


def _normalised(x, root):
    """``x t h / root t`` with Lean's ``x / 0 = 0``: ``root [...]`` is each row's square root.  Rows of
    root 0 are 0 and the others divided as arrays (``real.div`` per element costs a quarter more)."""
    zero = (root == 0)[..., None]
    return np.where(zero, mp.zero, x / np.where(zero, mp.one, root[..., None]))


@oracle
def rmsnorm(eps, x, w):
    """``rmsnorm eps x w := fun t h => x t h / Real.sqrt ((∑ j, x t j ^ 2) / (H : ℝ) + eps) * w h``"""
    return _normalised(x, rms(eps, x)) * w


@oracle
def rmsnorm_offset(eps, x, w):
    """``rmsnormOffset eps x w := fun t h => x t h / Real.sqrt ((∑ j, x t j ^ 2) / (H : ℝ) + eps) * (1 + w h)``"""
    return _normalised(x, rms(eps, x)) * (1 + w)


@oracle
def rmsnorm_unit(eps, x):
    """``rmsnormUnit eps x := fun t h => x t h / Real.sqrt ((∑ j, x t j ^ 2) / (H : ℝ) + eps)``"""
    return _normalised(x, rms(eps, x))


@oracle
def rmsnorm_gated(eps, x, z, w):
    """``rmsnormGated eps x z w := fun t h => w h * (x t h / Real.sqrt ((∑ j, x t j ^ 2) / (H : ℝ) + eps)) * silu (z t h)``"""
    return w * _normalised(x, rms(eps, x)) * silu(z)


@oracle
def l2norm(eps, x):
    """``l2norm eps x := fun t h => x t h / Real.sqrt (∑ j, x t j ^ 2 + eps)``"""
    return _normalised(x, _per_row(lambda squares: real.sqrt(squares + eps), x))
