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
    """Round an array in A to D and back to A (float32, or float64 for float64); None where D is A."""
    d, a = format_of(dtype).dtype, format_of(ACCUMULATION[dtype]).dtype
    if d == a:
        return None, a

    def round_d(x):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(x).astype(d).astype(a)

    return round_d, a


def _logits(scale, q, k, round_d, a) -> dict[str, np.ndarray]:
    """The logits in A (values of D) under each place of the scale (SCALE_AT); q.k in A is one product
    for the first two, and where D is A (``round_d`` None) they are one array."""
    s = a.type(scale)
    root = np.sqrt(s)
    product = np.einsum("scge,lce->scgl", q, k, optimize=True)
    if round_d is None:
        return {"product": product * s, "query": np.einsum("scge,lce->scgl", q * s, k, optimize=True),
                "split": np.einsum("scge,lce->scgl", q * root, k * root, optimize=True)}
    return {"product": round_d(round_d(product) * s),
            "accumulated": round_d(product * s),
            "query": round_d(np.einsum("scge,lce->scgl", round_d(q * s), k, optimize=True)),
            "split": round_d(np.einsum("scge,lce->scgl", round_d(q * root), round_d(k * root), optimize=True))}


def _weighted(logits, visible, v, round_d, softmax_in: str) -> np.ndarray:
    """The softmax of ``logits`` (in D or in A, SOFTMAX_IN; one where D is A) times v, accumulated in A and
    rounded to D."""
    round_d = round_d or (lambda x: x)
    mask = np.broadcast_to(visible[:, None, None, :], logits.shape)
    top = np.max(logits, axis=-1, keepdims=True, where=mask, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0)
    if softmax_in == "dtype":
        e = np.where(mask, round_d(np.exp(round_d(logits - top))), 0)
    else:
        e = np.where(mask, np.exp(logits - top), 0)
    total = np.sum(e, axis=-1, keepdims=True)
    p = round_d(e / np.where(total > 0, total, 1))
    return round_d(np.einsum("scgl,lcd->scgd", p, v, optimize=True)).astype(np.float64)


def arrangements(inputs: AttentionInputs, args: tuple, dtype: str) -> list[np.ndarray]:
    """The output of the op whose arguments ``inputs`` reads under every plain arrangement, in the op's
    output shape (float64): q [S, Hkv, G, D], k, v [L, Hkv, D], visible [S, L]; rows with nothing
    visible are 0.  Where D is A, arrangements that differ only in roundings to D are one computation."""
    scale, visible, q, k, v = inputs(args)
    round_d, a = _rounder(dtype)
    q, k, v = q.astype(a), k.astype(a), v.astype(a)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        logits = _logits(scale, q, k, round_d, a)
        computed, outputs = {}, []
        for at, where in itertools.product(SCALE_AT, SOFTMAX_IN):
            key = (at, where) if round_d is not None else ("product" if at == "accumulated" else at, "accumulation")
            if key not in computed:
                computed[key] = inputs.output(_weighted(logits[key[0]], visible, v, round_d, key[1]))
            outputs.append(computed[key])
        return outputs
