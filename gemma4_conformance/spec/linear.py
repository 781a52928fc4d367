"""Linear.lean: linear maps, feed-forward activations, residuals, embeddings, the LM head."""

import numpy as np

from .basic import gelu_tanh, silu, softcap
from .exact import dots, oracle


@oracle(summed=("W", "x"))
def linear(W, x):
    """``linear W x := fun t n => ∑ k, x t k * W n k``: ``W [N, K]``, ``x [..., K]`` -> ``[..., N]``."""
    return dots(x, W)


@oracle(summed=("Wg", "Wu", "x"))
def gate_up(Wg, Wu, x):
    """``gateUp Wg Wu x := fun t n => if n < I then linear Wg x t n else linear Wu x t (n - I)``"""
    return np.concatenate([linear(Wg, x), linear(Wu, x)], axis=-1)


@oracle
def silu_mul(gu):
    """``siluMul gu := fun t i => silu (gu t i) * gu t (I + i)``"""
    I = gu.shape[-1] // 2
    return silu(gu[..., :I]) * gu[..., I:]


@oracle
def gelu_mul(gu):
    """``geluMul gu := fun t i => geluTanh (gu t i) * gu t (I + i)``"""
    I = gu.shape[-1] // 2
    return gelu_tanh(gu[..., :I]) * gu[..., I:]


@oracle
def residual(r, x, h):
    """``residual r x h := fun t i => x t i + r * h t i``"""
    return x + h * r  # the array first: an mpf first would try, and fail, to convert it (formatting it for the error)


@oracle
def embed(c, E, tokens):
    """``embed c E tokens := fun t i => c * E (tokens t) i``: ``E [V, H]``, ``tokens [T]`` -> ``[T, H]``."""
    return E[np.asarray(tokens)] * c  # the array first, as in residual


@oracle(summed=("W", "x"))
def lm_head(mul, cap, W, x):
    """``lmHead mul cap W x``: ``W [V, H]``, ``x [..., H]`` -> ``[..., V]``.

    .. code-block:: lean

        fun t v => match cap with
          | none => mul * linear W x t v
          | some c => softcap c (mul * linear W x t v)
    """
    logits = linear(W, x) * mul  # the array first, as in residual
    return logits if cap is None else softcap(cap, logits)
