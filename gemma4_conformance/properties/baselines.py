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
from collections.abc import Callable
from functools import partial

import numpy as np

from gemma4_conformance.spec import format_of
from gemma4_conformance.spec.compiled import jit
from gemma4_conformance.spec.exact import widened

from .budget import ACCUMULATION
from .error_models import (AttentionInputs, attention_dots, attention_softmax, head_logits, head_sums, masked_softmax,
                           moved_logits_term)

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


def _logits(scale, q, k, a) -> dict[str, np.ndarray]:
    """The logits where D is A: the scale applied to the product, or to q, or split over q and k
    (SCALE_AT's other places are the first there)."""
    s = a.type(scale)
    root = np.sqrt(s)
    return {"product": head_logits(q, k) * s, "query": head_logits(q * s, k),
            "split": head_logits(q * root, k * root)}


def _sums(scale, q, k, round_d, a) -> dict[str, tuple[np.ndarray, Callable, tuple]]:
    """Per place of the scale (SCALE_AT), the dot products in A before the roundings to D, what turns
    them into that arrangement's logits, and the factors they are the dot products of (q.k in A is one
    product for the first two)."""
    s = a.type(scale)
    root = np.sqrt(s)
    product = head_logits(q, k)
    query, split = round_d(q * s), (round_d(q * root), round_d(k * root))
    return {"product": (product, lambda x: round_d(round_d(x) * s), (q, k)),
            "accumulated": (product, lambda x: round_d(x * s), (q, k)),
            "query": (head_logits(query, k), round_d, (query, k)),
            "split": (head_logits(*split), round_d, split)}


def moved_logits(sums, scale, visible, magnitudes, dots, dtype) -> dict[str, np.ndarray]:
    """Per narrow arrangement (``_sums``), how far another order of accumulating its dot products can move
    each logit [S, Hkv, G, L] (0 where masked, inf where it may overflow): the distance between the
    logits that the two ends of the dot product's interval give.

    Every order's dot product of q' and k' in A lies within gamma_(D-1) sum_e |q'_e k'_e| of the exact
    one (products of values of D are exact in A; an underflow costs 2^-149 a term), which float64 finds
    within gamma_D of float64 of the same sum.  sum_e |q'_e k'_e| is sum_e |q_e k_e| for the first two
    places and at most |scale| (1 + 4 u_D) times it where q (and k) are rounded to D after the scale
    (|scale| sum_e |q_e k_e| is ``magnitudes``, the error models' a_l, in float64; q.k is ``dots``).
    Turning a dot product into a logit (rounding, the scale) is monotone, so the interval's ends bound
    every order's logit.  At scale 1 every place is the first: q and k stay as they are."""
    if scale == 0:  # every logit is 0
        return {at: np.zeros(magnitudes.shape) for at in sums}
    D = next(iter(sums.values()))[2][0].shape[-1]
    u, u_a = format_of(dtype).eps, format_of(ACCUMULATION[dtype]).eps
    gamma = ((D - 1) * u_a / (1 - (D - 1) * u_a) + D * 2.0**-52) * (1 + 2.0**-40)  # the second: the float64 sum's
    mask = np.broadcast_to(visible[:, None, None, :], magnitudes.shape)
    moved = {}
    lo, hi = (np.empty(magnitudes.shape, dtype=np.float32) for _ in range(2))
    with np.errstate(over="ignore", invalid="ignore"):
        for at, (_, logit, factors) in sums.items() if scale != 1 else [("product", sums["product"])]:
            scaled_first = at in ("product", "accumulated")  # their factors are q and k
            known = dots if scaled_first else head_logits(*(f.astype(np.float64) for f in factors))
            per = gamma * (1 / abs(scale) if scaled_first else 1 + 4 * u)
            _outward(known.reshape(-1), magnitudes.reshape(-1), per, D * 2.0**-149, lo.reshape(-1), hi.reshape(-1))
            gap = np.abs(logit(hi).astype(np.float64) - logit(lo))
            moved[at] = np.where(mask, np.where(np.isnan(gap), np.inf, gap), 0.0)
    return moved if scale != 1 else dict.fromkeys(sums, moved["product"])


@jit
def _outward(exact, magnitudes, per, floor, lo, hi):
    """The ends of exact -+ (per magnitudes + floor) in float32, rounded outward: each end moved out by
    2^-23 of its magnitude and float32's least subnormal before its rounding to nearest, which moves it
    by at most half that (float64's own roundings of the ends are far less)."""
    for i in range(exact.size):
        width = per * magnitudes[i] + floor
        out = width + (abs(exact[i]) + width) * 2.0**-23 + 2.0**-149
        lo[i] = np.float32(exact[i] - out)
        hi[i] = np.float32(exact[i] + out)


def _alike(logits: dict[str, np.ndarray]) -> dict[str, str]:
    """Each place of the scale's first place (in SCALE_AT's order) with the same logits: the arrangements
    there are one computation (at a scale that is a power of two, every place's are)."""
    same: dict[str, str] = {}
    for at, x in logits.items():
        same[at] = next((b for b in same if same[b] == b and np.array_equal(logits[b], x, equal_nan=True)), at)
    return same


def _reordering(moved, logits, same, visible, v) -> np.ndarray:
    """Per output query [S, Hkv, G, D], how far another order of accumulating the dot products moves a
    narrow arrangement's output (tolerances.yaml, attention's tier2): the largest over the arrangements
    of ``moved_logits_term`` at the arrangement's own logits, each moving by at most ``moved`` (the
    largest of the places with the same logits: the term grows with it)."""
    distinct = [at for at in same if same[at] == at]
    moves = np.stack([np.max([moved[at] for at in same if same[at] == b], axis=0) for b in distinct])
    term = np.zeros(moves.shape[1:-1] + (v.shape[-1],))
    rows = np.nonzero(np.any(moves > 0, axis=(0, -1)))  # (s, c, g) where a logit may move: all arrangements'
    if rows[0].size:
        n, every = len(distinct), (slice(None), *rows)
        d = moves[every].reshape(-1, moves.shape[-1])
        p, _ = masked_softmax(np.stack([logits[at] for at in distinct])[every].reshape(d.shape).astype(np.float64),
                              np.tile(visible[rows[0]], (n, 1)))
        heads = np.tile(rows[1], n)
        o = np.empty((len(heads), v.shape[-1]))
        for c in np.unique(heads):
            o[heads == c] = p[heads == c] @ v[:, c]
        spans = np.max(v, axis=0) - np.min(v, axis=0)  # [Hkv, D]: two averages of a head's values lie within it
        term[rows] = moved_logits_term(p, d, v, heads, o, spans[heads]).reshape(n, -1, v.shape[-1]).max(axis=0)
    return term


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


def arrangements(inputs: AttentionInputs, args: tuple, dtype: str) -> tuple[list[np.ndarray], np.ndarray | None]:
    """The output of the op whose arguments ``inputs`` reads under every plain arrangement, in the op's
    output shape (float64): q [S, Hkv, G, D], k, v [L, Hkv, D], visible [S, L]; rows with nothing
    visible are 0.  Where D is A, arrangements that differ only in roundings to D are one computation.
    With them, per output element, what another accumulation order may move them by (``_reordering``;
    None where D is A, whose plain arrangement is the tier's own model)."""
    scale, visible, q, k, v = inputs(args)
    round_d, a = _rounder(dtype)
    q, k, v = (widened(x).astype(a, copy=False) for x in (q, k, v))  # the judging's float64 copies, exact in A
    softmax_in = SOFTMAX_IN if round_d is not None else ("accumulation",)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        if round_d is None:
            logits = _logits(scale, q, k, a)
        else:
            sums = _sums(scale, q, k, round_d, a)
            logits = {at: logit(x) for at, (x, logit, _) in sums.items()}
        same = _alike(logits)
        distinct = [at for at in same if same[at] == at]
        weights = _weights(np.stack([logits[at] for at in distinct]), visible, round_d, softmax_in)  # all at once
        keys = [(at, where) for where in weights for at in distinct]
        p = np.concatenate(list(weights.values()))
        sums_v = _weighted(p.reshape(-1, *p.shape[2:]), v, round_d).reshape(len(keys), *p.shape[1:-1], -1)
        outputs = {key: inputs.output(out) for key, out in zip(keys, sums_v)}
    if round_d is None:  # one computation for the arrangements that differ only in roundings to D
        return [outputs[same.get(at, same["product"]), "accumulation"]
                for at, _ in itertools.product(SCALE_AT, SOFTMAX_IN)], None
    wide = tuple(widened(x) for x in args)  # the error models' own arguments: they share what they make of them
    _, _, magnitudes, _ = attention_softmax(inputs, wide)
    _, _, q64, k64, _ = inputs(wide)
    moved = moved_logits(sums, scale, visible, magnitudes, attention_dots(q64, k64), dtype)
    term = _reordering(moved, logits, same, visible, v.astype(np.float64))
    return [outputs[same[at], where] for at, where in itertools.product(SCALE_AT, SOFTMAX_IN)], inputs.output(term)
