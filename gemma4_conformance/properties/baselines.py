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
from functools import partial

import numpy as np

from gemma4_conformance.spec import format_of
from gemma4_conformance.spec.compiled import jit
from gemma4_conformance.spec.exact import widened

from .budget import ACCUMULATION
from .error_models import AttentionInputs, head_logits, head_sums

SCALE_AT = ("product", "accumulated", "query", "split")
SOFTMAX_IN = ("dtype", "accumulation")


@jit
def _round_float32(x, out, to_fp16):
    """Float32 values rounded to nearest even in bf16 (or fp16, ``to_fp16``), into ``out`` as float32: the
    bits are rounded (a carry moves the exponent up, past the largest finite to inf), fp16's overflow
    from 65520 is inf and its subnormals are rounded by adding 1/2, whose float32 ULP is their spacing
    2^-24; inf and nan pass.  Bit for bit what the casts there and back give (ml_dtypes' and numpy's, on
    every float32: tests/test_baselines.py samples them), in one pass where the casts take two, and
    numpy's fp16 cast is slow."""
    bits, out_bits = x.view(np.uint32), out.view(np.uint32)
    half = np.float32(0.5)
    for i in range(x.size):
        b = bits[i]
        magnitude = b & np.uint32(0x7FFFFFFF)
        if magnitude >= np.uint32(0x7F800000):
            out_bits[i] = b
        elif not to_fp16:
            out_bits[i] = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        elif magnitude >= np.uint32(0x477FF000):  # 65520
            out_bits[i] = (b & np.uint32(0x80000000)) | np.uint32(0x7F800000)
        elif magnitude >= np.uint32(0x38800000):  # 2^-14, fp16's smallest normal
            out_bits[i] = (b + np.uint32(0xFFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
        else:
            rounded = (abs(x[i]) + half) - half
            out[i] = rounded if b == magnitude else -rounded


def round_to_dtype(x, dtype: str) -> np.ndarray:
    """Float32 ``x`` rounded to bf16 or fp16 (``dtype``), as float32 (``_round_float32``)."""
    x = np.ascontiguousarray(x)
    if x.dtype != np.float32:  # a wider value would be rounded twice
        raise TypeError(f"round_to_dtype takes float32, not {x.dtype}")
    out = np.empty(x.shape, dtype=np.float32)
    _round_float32(x.reshape(-1), out.reshape(-1), dtype == "float16")
    return out


def _rounder(dtype):
    """Round an array in A to D and back to A (float32, or float64 for float64); None where D is A."""
    d, a = format_of(dtype).dtype, format_of(ACCUMULATION[dtype]).dtype
    if d == a:
        return None, a
    return partial(round_to_dtype, dtype=dtype), a


def _logits(scale, q, k, round_d, a) -> dict[str, np.ndarray]:
    """The logits in A (values of D) under each place of the scale (SCALE_AT); q.k in A is one product
    for the first two, and where D is A (``round_d`` None) they are one array."""
    s = a.type(scale)
    root = np.sqrt(s)
    product = head_logits(q, k)
    if round_d is None:
        return {"product": product * s, "query": head_logits(q * s, k), "split": head_logits(q * root, k * root)}
    return {"product": round_d(round_d(product) * s),
            "accumulated": round_d(product * s),
            "query": round_d(head_logits(round_d(q * s), k)),
            "split": round_d(head_logits(round_d(q * root), round_d(k * root)))}


def _weights(logits, visible, round_d, softmax_in: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The softmax of ``logits`` [..., S, Hkv, G, L] over the visible keys, rounded to D, in each of ``softmax_in``
    (SOFTMAX_IN): in D or in A (one where D is A); the two share the row's largest logit and its shift."""
    round_d = round_d or (lambda x: x)
    mask = np.broadcast_to(visible[:, None, None, :], logits.shape)
    top = np.max(logits, axis=-1, keepdims=True, where=mask, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0)
    shifted = logits - top
    weights = {}
    for where in softmax_in:
        if where == "dtype":
            e = np.where(mask, round_d(np.exp(round_d(shifted))), 0)
        else:
            e = np.where(mask, np.exp(shifted), 0)
        total = np.sum(e, axis=-1, keepdims=True)
        weights[where] = round_d(e / np.where(total > 0, total, 1))
    return weights


def _weighted(p, v, round_d) -> np.ndarray:
    """The weights ``p`` [S, Hkv, G, L] times v, accumulated in A and rounded to D, as float64 (every
    arrangement's weights stacked on S: one product)."""
    round_d = round_d or (lambda x: x)
    return round_d(head_sums(p, v)).astype(np.float64)


def arrangements(inputs: AttentionInputs, args: tuple, dtype: str) -> list[np.ndarray]:
    """The output of the op whose arguments ``inputs`` reads under every plain arrangement, in the op's
    output shape (float64): q [S, Hkv, G, D], k, v [L, Hkv, D], visible [S, L]; rows with nothing
    visible are 0.  Where D is A, arrangements that differ only in roundings to D are one computation."""
    scale, visible, q, k, v = inputs(args)
    round_d, a = _rounder(dtype)
    q, k, v = (widened(x).astype(a, copy=False) for x in (q, k, v))  # the judging's float64 copies, exact in A
    softmax_in = SOFTMAX_IN if round_d is not None else ("accumulation",)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        logits = _logits(scale, q, k, round_d, a)
        weights = _weights(np.stack(list(logits.values())), visible, round_d, softmax_in)  # all at once
        keys = [(at, where) for where in weights for at in logits]
        p = np.concatenate(list(weights.values()))
        sums = _weighted(p.reshape(-1, *p.shape[2:]), v, round_d).reshape(len(keys), *p.shape[1:-1], -1)
        outputs = {key: inputs.output(out) for key, out in zip(keys, sums)}
    if round_d is None:  # one computation for the arrangements that differ only in roundings to D
        return [outputs["product" if at == "accumulated" else at, "accumulation"]
                for at, _ in itertools.product(SCALE_AT, SOFTMAX_IN)]
    return [outputs[key] for key in itertools.product(SCALE_AT, SOFTMAX_IN)]
