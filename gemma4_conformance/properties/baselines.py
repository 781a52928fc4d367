"""Plain same-dtype attention: what engines that round inside the op get, for the second tier of its verdict.

Attention's worst-case model (tier 1, tolerances.yaml) lets every logit round to the dtype D, and at
Gemma's geometry in bf16 that allowance spans the whole range the output can take: an engine that
ignores q.k would pass it.  The second tier (FlashAttention's test) compares an engine's error with
what plain implementations in D actually make on the same inputs.  Engines round logits and softmax
in different places, so the baseline is the largest error over the arrangements found in practice:

* the scale applied to the rounded product q.k (Hugging Face's eager attention), to the product
  still in A before its one rounding (per-op JAX, its einsum accumulating in A), to q before the
  product, or as sqrt(scale) to both q and k (PyTorch's math SDPA); the logits rounded to D;
* the softmax in D (each of s - max, exp and the quotient rounded to D, as per-op JAX does) or in
  the accumulation format A with only the weights rounded to D (torch.softmax, HF's fp32 softmax);
* the weighted sum of values accumulated in A and rounded once to D.

Each takes exact inputs in D (numpy arrays of ml_dtypes/numpy floats) and returns float64 results
that are values of D.  For float32 and float64 (A = D) every arrangement is the plain computation.
"""

from __future__ import annotations

import itertools

import numpy as np

from gemma4_conformance.spec import format_of

from .budget import ACCUMULATION
from .error_models import AttentionInputs

SCALE_AT = ("product", "accumulated", "query", "split")
SOFTMAX_IN = ("dtype", "accumulation")


def _rounder(dtype):
    """Round an array in A to D and back to A (float32, or float64 for float64)."""
    d, a = format_of(dtype).dtype, format_of(ACCUMULATION[dtype]).dtype

    def round_d(x):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(x).astype(d).astype(a)

    return round_d, a


def attention(scale, visible, q, k, v, dtype, scale_at: str, softmax_in: str) -> np.ndarray:
    """q [S, Hkv, G, D], k, v [L, Hkv, D], visible [S, L]: one plain arrangement; rows with nothing visible are 0."""
    round_d, a = _rounder(dtype)
    q, k, v = q.astype(a), k.astype(a), v.astype(a)
    s = a.type(scale)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        if scale_at == "product":
            logits = round_d(round_d(np.einsum("scge,lce->scgl", q, k, optimize=True)) * s)
        elif scale_at == "accumulated":
            logits = round_d(np.einsum("scge,lce->scgl", q, k, optimize=True) * s)
        elif scale_at == "query":
            logits = round_d(np.einsum("scge,lce->scgl", round_d(q * s), k, optimize=True))
        else:
            root = np.sqrt(s)
            logits = round_d(np.einsum("scge,lce->scgl", round_d(q * root), round_d(k * root), optimize=True))
        mask = np.broadcast_to(visible[:, None, None, :], logits.shape)
        top = np.max(logits, axis=-1, keepdims=True, where=mask, initial=-np.inf)
        top = np.where(np.isfinite(top), top, 0)
        if softmax_in == "dtype":
            e = np.where(mask, round_d(np.exp(round_d(logits - top))), 0)
        else:
            e = np.where(mask, np.exp(logits - top), 0)
        total = np.sum(e, axis=-1, keepdims=True)
        p = round_d(e / np.where(total > 0, total, 1))
        out = round_d(np.einsum("scgl,lcd->scgd", p, v, optimize=True))
    return out.astype(np.float64)


def arrangements(inputs: AttentionInputs, args: tuple, dtype: str) -> list[np.ndarray]:
    """The output of the op whose arguments ``inputs`` reads under every plain arrangement, in the op's
    output shape (float64)."""
    scale, visible, q, k, v = inputs(args)
    return [inputs.output(attention(scale, visible, q, k, v, dtype, at, where))
            for at, where in itertools.product(SCALE_AT, SOFTMAX_IN)]
