"""Each op's error model as two arrays per output element: the *scale* and the *absolute* allowance.

Scale S: the magnitude at which ULPs are counted; a budget of b ULPs means
|computed - exact| <= b * ulp_D(S) + absolute.  For an op without cancellation S is the exact result
itself; where an implementation in finite precision cannot avoid cancelling (a sum with mixed signs,
a rotation, a softmax over large logits) S is the sum of the magnitudes the rounding errors scale
with, so a budget holds for every input and is as sharp as the mathematics allows.

Absolute: what the model bounds in absolute terms rather than in ULPs of D, added after the ULPs so
that the budget counts only roundings in D:

* flush: a value below the smallest normal number (2^emin) may come out as zero, as flush-to-zero
  hardware does and as exp() overflowing in 1 / (1 + exp(-x)) does, and every factor applied after
  it scales that loss: x in x * sigmoid(x), c in c * tanh(x / c), the K terms of a dot product.  For
  a product of factors f_i computed in any order, every partial product is such an intermediate,
  and the loss is at most prod(1 + |f_i|) * 2^emin (``product_flush``).  Intermediates in the
  accumulation format flush at its own 2^emin.  It is 0 where the result must be exactly zero
  (masked entries, rows with nothing visible).
* steps the model puts in the accumulation format A (float32 for bf16 and fp16) whose error depends
  on the data, bounded once with A's unit roundoff: a RoPE angle pos * w, GELU's tanh before
  1 + tanh t cancels, attention's logits and softmax in an engine that keeps them in A.  Counted as
  ULPs of D at the scale, such a term would be multiplied by the whole budget.

Each function takes the op's arguments (floats widened to float64, which is exact), the exact result
rounded to float64 (the model sizes a budget; it does not define correctness, so float64 is enough)
and the dtype name.  The derivations are in tolerances.yaml.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from gemma4_conformance import spec
from gemma4_conformance.adapters import kv_cache_format
from gemma4_conformance.checkpoints.quantized import FP8_ACTIVATIONS, FP8_TYPES, FP8_WEIGHTS
from gemma4_conformance.spec import format_of, scale_ulp
from gemma4_conformance.spec.compiled import jit
from gemma4_conformance.spec.exact import products, shared

from .budget import ACCUMULATION, accumulation_ratio, tau

GELU_K = math.sqrt(2 / math.pi)


def tiny(dtype) -> float:
    """The smallest normal number of the dtype."""
    return 2.0 ** format_of(dtype).emin


def tiny_accumulated(dtype) -> float:
    """The smallest normal number of the dtype's accumulation format."""
    return tiny(ACCUMULATION[dtype])


def product_flush(dtype, *factors):
    """prod(1 + |f_i|) * 2^emin: the most a product computed in any order loses to flushed partials
    (in place where a factor adds no axis, one pass a factor)."""
    out = tiny(dtype)
    for f in factors:
        if isinstance(out, np.ndarray) and np.ndim(f) == 0:
            out *= 1 + abs(f)
        elif isinstance(out, np.ndarray) and np.shape(f) == out.shape and out.flags.c_contiguous:
            _times_one_plus_abs(out.reshape(-1), np.ascontiguousarray(f, dtype=np.float64).reshape(-1))
        else:
            out = out * (1 + np.abs(f))
    return out


@jit
def _times_one_plus_abs(out, f):
    """out (1 + |f|) into out, rounded as numpy rounds it in two steps."""
    for i in range(out.size):
        out[i] = out[i] * (1 + abs(f[i]))


def exact_magnitude(args, exact, dtype):
    """|y|: ops whose roundings are all relative to the result; only the result may flush."""
    return np.abs(exact), tiny(dtype)


def silu(args, exact, dtype):
    """|y|; sigmoid(x) may flush before the product with x."""
    (x,) = args
    return np.abs(exact), product_flush(dtype, x, 1.0)


@jit
def _gelu_absolute(x, up, eps_accumulation, tau_plus_one, tiny_d, out):
    """GELU's absolute allowance per element: eps_A g(x) |up| + tiny (1 + |x|) 2 (1 + |up|), the last
    factors only where ``up`` is given (gelu_mul; gelu_tanh has none), with

        g(x) = |x|/2 (7 |t| sech^2 t + (TAU + 1) |tanh t|) + 2 |gelu(x)|,  t = k (x + 0.044715 x^3),

    what GELU's steps in A cost in units of u_A.  t takes seven roundings relative to |t| (x^2, x^3, the
    two constants, their product, the sum, the factor), each moving y by |x|/2 |t| sech^2 t; tanh t
    errs by TAU and rounds once, relative to |tanh t|, before 1 + tanh t cancels (x << 0); 1 + tanh t
    and x/2 (1 + tanh t) round once each relative to |y|.  x may flush before the products.

    One exp gives all three: with e = e^(-2t), sech^2 t = 4 e / (1 + e)^2, tanh t = (1 - e) / (1 + e) and
    x/2 (1 + tanh t) = x / (1 + e), uncancelled (-2t capped at 700, where they are 0, -1 and 0 to float64's
    precision).  1 - e cancels where t is small: tanh t is then off by about u, which moves g(x) by
    |x| u, against its term 2 |gelu(x)| of about |x|."""
    gated = up.size > 0
    for i in range(x.size):
        v = x[i]
        t = GELU_K * (v + 0.044715 * (v * v * v))
        exponent = -2 * t
        e = math.exp(exponent if not exponent > 700 else 700.0)
        slope = abs(t) * (4 * e / ((1 + e) * (1 + e)))
        gelu = v / (1 + e)
        steps = abs(v) / 2 * (7 * slope + tau_plus_one * abs((1 - e) / (1 + e))) + 2 * abs(gelu)
        if gated:
            out[i] = eps_accumulation * steps * abs(up[i]) + tiny_d * (1 + abs(v)) * (1 + 1.0) * (1 + abs(up[i]))
        else:
            out[i] = eps_accumulation * steps + tiny_d * (1 + abs(v)) * (1 + 1.0)


def _gelu_allowance(x, up, dtype):
    x = np.ascontiguousarray(x, dtype=np.float64)
    out = np.empty(x.shape)
    _gelu_absolute(x.reshape(-1), np.ascontiguousarray(up, dtype=np.float64).reshape(-1),
                   format_of(ACCUMULATION[dtype]).eps, tau(dtype) + 1, tiny(dtype), out.reshape(-1))
    return out


def gelu_tanh(args, exact, dtype):
    """|y|; the steps in A bounded absolutely (``_gelu_absolute``); x may flush before the product."""
    (x,) = args
    return np.abs(exact), _gelu_allowance(x, np.zeros(0), dtype)


def softcap(args, exact, dtype):
    """|y|; x / c may flush before the product with c: product_flush(D, c, x / c, 1) (``_softcap_flush``)."""
    c, x = args
    flush = np.empty(np.shape(x))
    _softcap_flush(float(c), np.ascontiguousarray(x, dtype=np.float64).reshape(-1), tiny(dtype), flush.reshape(-1))
    return np.abs(exact), flush


@jit
def _softcap_flush(c, x, tiny_d, out):
    """tiny (1 + |c|) (1 + |x / c|) (1 + 1) per element, rounded as ``product_flush`` rounds it; x / 0 is 0
    (Lean's)."""
    head = tiny_d * (1 + abs(c))
    for i in range(x.size):
        out[i] = head * (1 + abs(x[i] / c if c != 0 else 0.0)) * (1 + 1.0)


def _gate_up(gu):
    half = gu.shape[-1] // 2
    return gu[..., :half], gu[..., half:]


def silu_mul(args, exact, dtype):
    """|y|; sigmoid(gate) or silu(gate) may flush before the products with gate and up."""
    gate, up = _gate_up(args[0])
    return np.abs(exact), product_flush(dtype, gate, 1.0, up)


def gelu_mul(args, exact, dtype):
    """|y|; gelu(gate)'s steps in A, times |up|; the product with up in D or A."""
    gate, up = _gate_up(args[0])
    return np.abs(exact), _gelu_allowance(gate, up, dtype)


def sigmoid_gate(args, exact, dtype):
    """|y|; sigmoid(gate) may flush before the product with o."""
    o, gate = args
    return np.abs(exact), product_flush(dtype, o, 1.0)


def residual(args, exact, dtype):
    """|x| + |r h|: the two terms of the sum; r h may flush."""
    r, x, h = args
    return np.abs(x) + np.abs(r * h), product_flush(dtype, r, h)


def _normalisation(eps, x, mean=True):
    """The normalised x and 1 / rms, in float64; 1 / rms is 0 where the spec's is (Lean's Real.sqrt of
    0 or less is 0, and 1 / 0 = 0)."""
    total = np.mean(x * x, axis=-1, keepdims=True) if mean else np.sum(x * x, axis=-1, keepdims=True)
    root = np.sqrt(np.maximum(total + eps, 0.0))
    inverse = np.divide(1, root, out=np.zeros_like(root), where=root > 0)
    return x * inverse, inverse


def _norm(args, exact, dtype, mean=True, offset=False, gated=False):
    """|y|; the norm is formed in the accumulation format (factors x, 1/rms and the weights) and the
    normalised x may then be rounded to the dtype and multiplied there (factors x_hat and the weights):
    ``product_flush`` of each, summed (``_norm_flush``).  The weights are 1 + |w| where ``offset``; a
    gated norm's silu(z) = z sigmoid(z) adds the factors z and sigmoid(z) <= 1."""
    eps, x, *rest = args
    x_hat, inverse = _normalisation(eps, x, mean)
    w = (1 + np.abs(rest[-1]) if offset else rest[-1]) if rest else np.zeros(0)
    z = rest[0] if gated else np.zeros((0, 0))
    H = x.shape[-1]
    flush = np.empty(np.shape(x))
    _norm_flush(*(np.ascontiguousarray(a, dtype=np.float64).reshape(-1, H) for a in (x, x_hat)),
                np.ascontiguousarray(inverse, dtype=np.float64).reshape(-1), np.ascontiguousarray(w, dtype=np.float64),
                np.ascontiguousarray(z, dtype=np.float64).reshape(-1, H) if gated else z, gated, tiny(dtype),
                tiny_accumulated(dtype), flush.reshape(-1, H))
    return np.abs(exact), flush


@jit
def _norm_flush(x, x_hat, inverse, w, z, gated, tiny_d, tiny_a, out):
    """product_flush(D, x_hat, w, z, 1) + product_flush(A, x, 1/rms, w, z, 1) per element, with the factors
    a norm has (w, z and the 1 where given), rounded as ``product_flush`` rounds them."""
    weighted, gate = w.size > 0, z.size > 0
    for n in range(x.shape[0]):
        for k in range(x.shape[1]):
            in_d = tiny_d * (1 + abs(x_hat[n, k]))
            in_a = tiny_a * (1 + abs(x[n, k])) * (1 + abs(inverse[n]))
            if weighted:
                in_d, in_a = in_d * (1 + abs(w[k])), in_a * (1 + abs(w[k]))
            if gate:
                in_d, in_a = in_d * (1 + abs(z[n, k])), in_a * (1 + abs(z[n, k]))
            if gated:
                in_d, in_a = in_d * (1 + 1.0), in_a * (1 + 1.0)
            out[n, k] = in_d + in_a


def rms(args, exact, dtype):
    return np.abs(exact), tiny(dtype)


def rmsnorm(args, exact, dtype):
    return _norm(args, exact, dtype)


def rmsnorm_offset(args, exact, dtype):
    return _norm(args, exact, dtype, offset=True)


def rmsnorm_unit(args, exact, dtype):
    return _norm(args, exact, dtype)


def rmsnorm_gated(args, exact, dtype):
    return _norm(args, exact, dtype, gated=True)


def l2norm(args, exact, dtype):
    return _norm(args, exact, dtype, mean=False)


def _products(x, W, signed=False):
    """|x| @ |W|.T, (1 + |x|) @ (1 + |W|).T and, when ``signed``, x @ W.T, in float64
    (``spec.exact.products``, shared with the enclosure's).  The second is |x| @ |W|.T + sum_k |x_k| +
    sum_k |W_nk| + K."""
    K = x.shape[-1]
    rows = x.reshape(-1, K)
    logits, dots, sums = products(rows, W, signed)
    flush = dots + np.abs(rows).sum(axis=-1, keepdims=True) + sums + K
    shape = x.shape[:-1] + (W.shape[0],)
    return [a.reshape(shape) for a in (dots, flush) + ((logits,) if signed else ())]


def inner_products(args, exact, dtype):
    """sum_k |x_k W_nk| for linear, and for gate_up over both weights (gamma_K bound of a dot
    product); each of the K products may flush."""
    *weights, x = args
    dots, flush = (np.concatenate(parts, axis=-1) for parts in zip(*(_products(x, W) for W in weights)))
    return dots, tiny(dtype) + flush * tiny_accumulated(dtype)


def lm_head(args, exact, dtype):
    """|y| + |mul| slope sum_k |x_k W_vk|: an error d in the logit L moves y by at most |mul| d times
    the largest slope sech^2(mul l / cap) for l within d of L (the cap flattens the error, until the
    logit's own uncertainty reaches the steep part).  d bounds the accumulation, the rounding of L and
    of mul L, and the float64 logit computed here."""
    mul, cap, W, x = args
    K = x.shape[-1]
    dots, flush, logits = _products(x, W, signed=True)
    flush = tiny(dtype) * (1 + abs(mul)) * (2 + (abs(cap) if cap is not None else 0.0)) + \
        abs(mul) * flush * tiny_accumulated(dtype)
    if cap is None:
        return np.abs(mul) * dots, flush
    if cap == 0:  # softcap 0 y = 0 * tanh (y / 0) = 0, Lean's y / 0 being 0: a constant, nothing to scale
        return np.abs(exact), flush
    return _capped_scale(mul, cap, np.abs(exact), dots, logits, K, dtype), flush


def _capped_scale(mul, cap, magnitude, dots, logits, K, dtype):
    """lm_head's scale with a cap: magnitude (|y|) + |mul| slope dots, the slope at its steepest for a
    logit within its uncertainty of ``logits``."""
    u, u_acc = format_of(dtype).eps, format_of(ACCUMULATION[dtype]).eps
    uncertainty = (K * u_acc + 2 * u + K * 2.0**-52) * dots
    nearest = np.maximum(np.abs(logits) - uncertainty, 0.0)
    slope = 1 / np.cosh(np.minimum(abs(mul) * nearest / cap, 350)) ** 2
    return magnitude + np.abs(mul) * slope * dots


def lm_head_logit_overflows(args, exact, dtype, declared=0.0):
    """Where the model's own logit L = sum_k x_k W_vk, rounded to D before the product with mul, may
    round past D's largest finite value: there the spec's mul * L can be finite (mul < 1) while the
    arrangement the budget models gives +-inf, so an inf with the exact result's sign is accepted.
    L's error in A (gamma_K) and of the float64 product here count towards reaching the overflow, and so
    does what the declared roundings move L by: ``declared``, their term on the output, is |mul| times
    it (lm_head_declared_activations, and the fp8 weights' term likewise)."""
    mul, cap, W, x = args
    K = x.shape[-1]
    f = format_of(dtype)
    dots, _, logits = _products(x, W, signed=True)
    uncertainty = (K * format_of(ACCUMULATION[dtype]).eps + K * 2.0**-52) * dots
    if mul != 0:
        uncertainty = uncertainty + np.asarray(declared) / abs(mul)
    # the least magnitude that rounds to inf (Python floats: float64's is past its own range, inf)
    overflow = f.max_finite + float(scale_ulp(f.max_finite, dtype)) / 2
    return np.abs(logits) + uncertainty >= overflow


@functools.lru_cache(maxsize=64)
def _frequencies(theta, denom, active, n) -> np.ndarray:
    """Lean's inverse frequencies (denom = 0 too) rounded to float64, one per rotated pair: the same
    for every call of a model's rope."""
    frequencies = spec.round_to(spec.inv_freq(theta, denom, active, np.arange(n)), "float64")
    frequencies.flags.writeable = False
    return frequencies


@functools.lru_cache(maxsize=64)
def _angle_factors(theta, denom, active, n, dtype):
    """(the inverse frequencies, 2 + TAU + |ln w| of each): ``rope``'s per rotated pair."""
    freqs = _frequencies(theta, denom, active, n).astype(np.float64)
    factors = np.array([2 + tau(dtype) + (abs(math.log(abs(w))) if w else 0.0) for w in freqs.tolist()])
    freqs.flags.writeable = factors.flags.writeable = False
    return freqs, factors


def rope(args, exact, dtype):
    """r per rotated coordinate, r the pair's norm; the angle a = pos w's own error bounded absolutely.

    The angle is computed in the accumulation format A: 2i/denom and the product round once each (2),
    the power errs by up to TAU, and rounding 2i/denom moves w by |ln w| relatively, so a errs by at
    most u_A |a| (2 + TAU + |ln w|), which moves the output by at most r times that.  Pass-through
    coordinates scale with |x|.
    """
    *head, pos, x = args
    theta, rot, denom, active = head if len(head) == 4 else (head[0], head[1], head[1], head[1] // 2)
    D = x.shape[-1]
    freqs, factors = _angle_factors(theta, denom, active, min(rot // 2, D), dtype)
    rows = np.ascontiguousarray(x, dtype=np.float64).reshape(math.prod(x.shape[:-1]), D)
    scale, absolute = np.empty(rows.shape), np.empty(rows.shape)
    _rope_model(rows, np.asarray(pos, dtype=np.float64).reshape(-1), freqs, factors, rot // 2,
                format_of(ACCUMULATION[dtype]).eps, tiny(dtype), scale, absolute)
    return scale.reshape(x.shape), absolute.reshape(x.shape)


@jit
def _rope_model(x, pos, freqs, factors, half, u_acc, tiny_d, scale, absolute):
    """``rope``'s scale and absolute allowance for rows x [N, D] at positions pos [N]: rotated pair i,
    i + half (i < freqs.size) at frequency freqs[i], whose angle's relative error is u_acc factors[i].
    The products with cos and sin may flush: 2^emin (1 + r) 2, twice.  The pair's norm r is the root of
    its squares' sum (a float64 rounding or two from hypot's; hypot where the squares leave float64's
    range)."""
    N, D = x.shape
    for n in range(N):
        for k in range(D):
            scale[n, k], absolute[n, k] = abs(x[n, k]), 0.0
        for i in range(freqs.size):
            j = i + half
            partner = x[n, j] if j < D else 0.0
            squares = x[n, i] * x[n, i] + partner * partner
            r = math.sqrt(squares) if 2.0**-900 < squares < 2.0**900 else math.hypot(x[n, i], partner)
            scale[n, i] = r
            absolute[n, i] = r * u_acc * abs(pos[n] * freqs[i]) * factors[i]
            if j < D:
                scale[n, j], absolute[n, j] = r, absolute[n, i]
        for k in range(D):
            absolute[n, k] += tiny_d * (1 + scale[n, k]) * (1 + 1.0) * 2


def inv_freq(args, exact, dtype):
    """|w|; w is computed in the accumulation format, where 2i/denom and a reciprocal round once each
    and rounding 2i/denom moves w by |ln w| relatively: u_A |w| (2 + |ln w|), bounded absolutely; the
    power's own error is the budget's fn."""
    w = np.abs(exact)
    with np.errstate(divide="ignore"):
        log_w = np.where(w > 0, np.abs(np.log(np.where(w > 0, w, 1.0))), 0.0)
    return w, format_of(ACCUMULATION[dtype]).eps * w * (2 + log_w) + tiny(dtype)


def head_logits(q, k):
    """sum_e q[s, c, g, e] k[l, c, e] as [S, Hkv, G, L]: one batched matrix product per KV head (einsum
    costs more to plan than products of these sizes take)."""
    return _per_head(q, k.transpose(1, 2, 0))


def head_sums(p, v):
    """sum_l p[s, c, g, l] v[l, c, d] as [S, Hkv, G, D], as ``head_logits``."""
    return _per_head(p, v.transpose(1, 0, 2))


def _per_head(x, y):
    S, C, G, K = x.shape
    return np.matmul(x.transpose(1, 0, 2, 3).reshape(C, S * G, K), y).reshape(C, S, G, -1).transpose(1, 0, 2, 3)


def visible_sums(visible, v):
    """sum_l visible[s, l] v[l, c, d] as [S, Hkv, D]."""
    return (visible.astype(v.dtype) @ v.reshape(v.shape[0], -1)).reshape(len(visible), *v.shape[1:])


def masked_softmax(logits, visible):
    """Softmax over the visible entries in float64, its shifted logits z = s - max, zeros elsewhere."""
    masked = np.where(visible, logits, -np.inf)
    top = np.max(masked, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    z = np.where(visible, logits - top, 0.0)
    e = np.where(visible, np.exp(z), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return p, z


def softmax(args, exact, dtype):
    """p_l (1 + |z_l| + sum_j p_j |z_j|): exp(z) turns an absolute error in z into a relative one,
    and the normalising sum spreads every term's error over the row.  p is the exact result (to float64:
    the model sizes a budget).  Masked entries must be exactly 0."""
    s, visible = args
    visible = np.broadcast_to(np.asarray(visible, dtype=bool), s.shape)
    scale = np.empty(s.shape)
    if s.size:
        _softmax_scale(np.ascontiguousarray(s, dtype=np.float64).reshape(-1), np.ascontiguousarray(visible).reshape(-1),
                       np.ascontiguousarray(np.broadcast_to(exact, s.shape), dtype=np.float64).reshape(-1),
                       s.shape[-1], scale.reshape(-1))
    return scale, 2 * tiny(dtype) if visible.all() else np.where(visible, 2 * tiny(dtype), 0.0)


@jit
def _softmax_scale(s, visible, p, L, scale):
    """``softmax``'s scale per row of L logits, in one pass a step: z = s - max over the visible ones (the
    max 0 where it is not finite, nan where a logit is), and p (1 + |z| + sum_j p_j |z_j|) where visible,
    0 elsewhere."""
    for start in range(0, s.size, L):
        top = -math.inf
        for j in range(start, start + L):
            if visible[j] and not s[j] <= top:
                top = s[j]
                if top != top:
                    break
        if not math.isfinite(top):
            top = 0.0
        spread = 0.0
        for j in range(start, start + L):
            spread += p[j] * abs(s[j] - top) if visible[j] else 0.0
        for j in range(start, start + L):
            scale[j] = p[j] * (1 + abs(s[j] - top) + spread) if visible[j] else 0.0


def _attention(scale, visible, q, k, v, dtype, parts=None):
    """sum_l p_l |v_l| w_l + (sum_l p_l |v_l|)(sum_j p_j w_j), w_l = 1 + |z_l| + a_l.

    a_l = |scale| sum_e |q_e k_le| bounds a logit's rounding errors (its accumulation and its rounding
    to D), z_l = s_l - max its exponent; an error in p_l's weight is relative, and the normalisation
    passes each weight's error to all.  visible is [S, L].  The weights p_l and the products p_l v_l
    may flush: 2^emin times the sum over visible keys of 2 (1 + |v_l|).

    A weight's relative error e^d - 1, for a logit-error bound d, is at most d e^|d|: the first-order
    scale is multiplied by e^(2 d_max), d_max = u_D (3 + ratio (TAU + D)) max_l w_l over the row (two
    logits' errors meet in each ratio p_l / p_m).  The case strategies keep d_max small, where the
    factor is near 1; beyond it the budget widens as the mathematics says it must.  ``parts``: _logits's,
    where they are known.
    """
    return _plain_model(*(parts or _logits(scale, visible, q, k)), np.abs(v), visible, dtype)


def _weighted_pair(p, weight, magnitude_v):
    """sum_l p_l |v_l| and sum_l p_l w_l |v_l| [S, Hkv, G, D], from one batched product."""
    both = head_sums(np.concatenate([p, p * weight]), magnitude_v)
    return both[:len(p)], both[len(p):]


def _plain_model(p, z, magnitudes, mask, magnitude_v, visible, dtype):
    """_attention from the softmax p, |z|, a_l, the mask [S, Hkv, G, L] and |v| [L, Hkv, D] (or bounds on
    them: the model grows with each)."""
    weight = np.where(mask, 1 + np.abs(z) + magnitudes, 0.0)
    pv, pwv = _weighted_pair(p, weight, magnitude_v)
    D = magnitude_v.shape[-1]
    d_max = format_of(dtype).eps * (3 + accumulation_ratio(dtype) * (tau(dtype) + D)) * np.max(weight, axis=-1)
    growth = np.exp(np.minimum(2 * d_max, 700))[..., None]
    flush = 2 * tiny(dtype) * visible_sums(visible, 1 + magnitude_v)[:, :, None, :]
    first_order = pwv + pv * np.sum(p * weight, axis=-1)[..., None]
    return first_order * growth, np.broadcast_to(flush, pwv.shape)


def attention_dots(q, k):
    """head_logits(q, k) of float64 q and k, once per assessment (the error models' logits and the plain
    arrangements' reordering share them)."""
    return shared("attention's dot products", (q, k), lambda: head_logits(q, k))


def _logits(scale, visible, q, k):
    """The exact logits' softmax p and shifted logits z [S, Hkv, G, L], |scale| sum_e |q_e k_le| and the mask."""
    logits = scale * attention_dots(q, k)
    magnitudes = abs(scale) * head_logits(np.abs(q), np.abs(k))
    mask = visible[:, None, None, :]
    p, z = masked_softmax(logits, mask)
    return p, z, magnitudes, mask


def _attention_in_accumulation(scale, visible, q, k, v, dtype, parts=None):
    """Scale sum_l p_l |v_l| and the absolute allowance of an engine that keeps logits and softmax in A
    (FlashAttention-style kernels, and most serving engines): the weights are rounded to D for the
    product with v (or kept in A), the weighted sum is accumulated in A and rounded once to D.

    In A, a logit errs by at most u_A ((D + 2) a_l) (gamma_D of its dot product, the scale held in A
    and the product with it), z_l = s_l - max by u_A |z_l| more, exp by u_A (TAU + 1): w_l = (D + 2)
    a_l + |z_l| + TAU + 1; the normalisation passes each weight's error to all, as in the plain model;
    the sum of exponentials, the quotient, the rescaling of an online softmax and the weighted sum of
    values cost u_A (L + 2) sum_l p_l |v_l|.  Absolute: u_A (sum_l p_l |v_l| (w_l + L + 2) +
    (sum_l p_l |v_l|)(sum_j p_j w_j)), plus what may flush (as in the plain model).  The budget counts
    the roundings in D: each weight's, relative u_D (1), and the output's (0.5).
    """
    return _in_accumulation_model(*(parts or _logits(scale, visible, q, k)), np.abs(v), visible, dtype)


def _in_accumulation_model(p, z, magnitudes, mask, magnitude_v, visible, dtype):
    """_attention_in_accumulation from the softmax parts and |v|, as _plain_model."""
    D, L = magnitude_v.shape[-1], magnitude_v.shape[0]
    weight = np.where(mask, (D + 2) * magnitudes + np.abs(z) + tau(dtype) + 1, 0.0)
    pv, pwv = _weighted_pair(p, weight, magnitude_v)
    in_accumulation = pwv + pv * (np.sum(p * weight, axis=-1)[..., None] + L + 2)
    flush = 2 * tiny(dtype) * visible_sums(visible, 1 + magnitude_v)[:, :, None, :]
    return pv, format_of(ACCUMULATION[dtype]).eps * in_accumulation + flush


@dataclass(frozen=True)
class AttentionInputs:
    """How an attention op's arguments read as (scale, visible [S, L], q [S, Hkv, G, D], k, v), and
    its output as [S, Hkv, G, D]: decode is one query at L - 1, its output that query's."""

    read: Callable  # args -> (scale, visible, q, k, v)
    one_query: bool = False

    def __call__(self, args):
        return self.read(args)

    def output(self, queries):
        """The op's output from its queries' [S, Hkv, G, D]."""
        return queries[0] if self.one_query else queries


def _causal(args):
    scale, pos, q, k, v = args
    return scale, np.arange(k.shape[0])[None, :] <= np.asarray(pos)[:, None], q, k, v


def _sliding(args):
    scale, window, pos, q, k, v = args
    keys, pos = np.arange(k.shape[0])[None, :], np.asarray(pos)[:, None]
    return scale, (keys <= pos) & (pos < keys + window), q, k, v


def _decode(args):
    scale, q, k, v = args
    return scale, np.ones((1, k.shape[0]), dtype=bool), q[None], k, v


CAUSAL, SLIDING = AttentionInputs(_causal), AttentionInputs(_sliding)
DECODE = AttentionInputs(_decode, one_query=True)


def attention_softmax(inputs, args):
    """``_logits``'s parts of an attention op's arguments (as ``inputs`` reads them), once per assessment:
    both tiers' models and the plain arrangements share them."""
    scale, visible, q, k, _ = inputs(args)
    return shared("attention's softmax", args, lambda: _logits(scale, visible, q, k))


def _per_op(model, inputs, name):
    def modelled(args, dtype):
        scale, visible, q, k, v = inputs(args)
        model_scale, absolute = model(scale, visible, q, k, v, dtype, attention_softmax(inputs, args))
        return inputs.output(model_scale), inputs.output(absolute)

    def error_model(args, exact, dtype):  # of the arguments alone: once per assessment, however often judged
        return shared(error_model.__name__, (*args, dtype), lambda: modelled(args, dtype))

    error_model.__name__ = f"{name}_{model.__name__.strip('_')}"
    return error_model


_INPUTS = ((CAUSAL, "causal_gqa"), (SLIDING, "sliding_gqa"), (DECODE, "decode_gqa"))
causal_gqa, sliding_gqa, decode_gqa = (_per_op(_attention, inputs, name) for inputs, name in _INPUTS)
causal_gqa_in_accumulation, sliding_gqa_in_accumulation, decode_gqa_in_accumulation = (
    _per_op(_attention_in_accumulation, inputs, name) for inputs, name in _INPUTS)


# ---- Declared roundings: what an adapter's ``formats`` add to the absolute allowance -------------------
#
# A declared rounding is a step the dtype under test does not make: the engine computes with the rounded
# value x^ of an input x.  |computed - exact| <= |computed - f(x^)| + |f(x^) - f(x)|: the first is the
# op's own error model evaluated at x^, whose scale is at most the scale at x plus what x^ moves it by;
# the second is at most the term.  So a declared rounding returns (scale's increase, term) per output
# element: the first added to the scale, the second to the absolute allowance.  The derivations are in
# tolerances.yaml (each op's ``declared``).

U32 = 2.0**-24  # float32's unit roundoff: llama.cpp forms its block scales and quotients in float32
# Activation blocks: (values per block, the format the scale is stored in: None where it stays float32)
ACTIVATION_BLOCKS = {"q8_0": (32, "float16"), "q8_k": (256, None)}


def activation_rounding(x, name: str) -> np.ndarray:
    """Per element, a bound on |x - x^| for x rounded to the activation blocks ``name`` along its last
    axis (a last, partial block as if padded with zeros), d = a / 127 for a = max |x| over the block:

        |x - x^| <= ((1 + u)^3 - 1) |x| + d (1 + v) / 2 + e min(127, |x| (1 + u)^3 / (d (1 - v)) + 1 / 2),

    u float32's unit roundoff, v = 2 u + u^2.  llama.cpp (``quantize_row_q8_0``, ``quantize_row_q8_K``)
    takes x in float32 (a factor within u of 1 for a float64 x, and its a within u), forms the scale d'
    (within v d of d: one more rounding) and its inverse in float32, and q = round(t), t = fl(x * inverse):
    x - d^ q = (x - d' t) + d' (t - q) + (d' - d^) q, d^ the stored scale.  x - d' t is at most
    ((1 + u)^3 - 1) |x| (x to float32, then the inverse and the product round once each), t - q at
    most 1/2, |q| <= |t| + 1/2 and at most 127, and d' - d^ is e: half an fp16 ULP at d (1 + v) for ``q8_0``, 0 for ``q8_k``
    (whose scale stays float32; its sign follows the block's extreme value, which changes nothing
    here).  A block of zeros is exact; an fp16 scale past 65504 is inf, and so is a block with an x past
    float32's largest value (inf there): no bound."""
    block, stored = ACTIVATION_BLOCKS[name]
    x = np.abs(np.asarray(x, dtype=np.float64))
    K = x.shape[-1]
    padded = np.zeros(x.shape[:-1] + (-(-K // block) * block,))
    padded[..., :K] = x
    amax = padded.reshape(x.shape[:-1] + (-1, block)).max(axis=-1)
    d = np.repeat(amax / 127, block, axis=-1)[..., :K]
    u = U32
    v = 2 * u + u * u
    e = np.zeros_like(d) if stored is None else scale_ulp(d * (1 + v), stored) / 2
    q = np.where(d > 0, np.minimum(127.0, x * (1 + u) ** 3 / (np.where(d > 0, d, 1.0) * (1 - v)) + 0.5), 0.0)
    bound = ((1 + u) ** 3 - 1) * x + d * (1 + v) / 2 + e * q
    if stored is not None:
        bound = np.where(d * (1 + v) > format_of(stored).max_finite, np.inf, bound)
    return np.where(d * 127 > F32_LARGEST, np.inf, bound)


def _moved(W, x, name):
    """sum_k |W_nk| |x_k - x^_k| per output (input_rounding): how far x^ moves a dot product."""
    return input_rounding(x, name) @ np.abs(W).T


def declared_activations(args, dtype, name):
    """linear and gate_up: the term T = sum_k |W_nk| |x_k - x^_k|, and the scale sum_k |W_nk| |x^_k| <=
    sum_k |W_nk| |x_k| + T grows by T."""
    *weights, x = args
    term = np.concatenate([_moved(W, x, name) for W in weights], axis=-1)
    return term, term


def lm_head_declared_activations(args, dtype, name):
    """lm_head: the logit moves by T (linear's), y by |mul| T (the cap's slope is at most 1); the scale
    at x^ is lm_head's with |y| + |mul| T, the dot products' magnitudes + T and the logits T nearer the
    cap's steep part, minus the scale at x (a constant output, cap 0, moves nothing)."""
    mul, cap, W, x = args
    return _lm_head_moved(mul, cap, W, x, dtype, _moved(W, x, name))


def _lm_head_moved(mul, cap, W, x, dtype, moved, before=0.0):
    """lm_head's (scale's increase, term) for logits moved by ``moved`` beyond ``before`` (what another
    declared rounding moves them by, whose own increase that rounding's term holds)."""
    if cap == 0:
        return np.zeros_like(moved), np.zeros_like(moved)
    if cap is None:
        return abs(mul) * moved, abs(mul) * moved
    dots, _, logits = _products(x, W, signed=True)
    K = x.shape[-1]

    def at(m):  # |y| left out: it cancels
        nearer = np.maximum(np.abs(logits) - m, 0.0)
        return _capped_scale(mul, cap, abs(mul) * m, dots + m, nearer, K, dtype)

    return np.maximum(at(before + moved) - at(before), 0.0), abs(mul) * moved


# ---- fp8 inputs of the products (issue 36, item 4) ---------------------------------------------------
#
# torch._scaled_mm and the fp8 GEMMs of the H100 and H200 multiply fp8 operands (float8_e4m3fn,
# float8_e5m2), accumulate the exact products in float32 and multiply by the operands' float32 scales:
# dynamic scaling (vLLM's and torchao's) takes s = max |x| / M over a row (a token of x, an output channel
# of W) or the whole tensor, q = fp8(x / s), so x^ = s q.  The derivation is fp8_rounding's docstring and
# tolerances.yaml's ``declared``.

# per fp8 kind: significand bits after the point, the exponent of the smallest normal, the largest finite
# value, from ml_dtypes (e4m3fn has no inf: 0x7f is NaN and 448 = 1.75 * 2^8 its largest; e5m2 is
# IEEE-like, 57344 then inf)
FP8 = {kind: (int(info.nmant), int(info.minexp), float(info.max))
       for kind, info in ((kind, ml_dtypes.finfo(t)) for kind, t in FP8_TYPES.items())}
F32_SUBNORMAL = 2.0**-149  # float32's smallest subnormal: below its normal range roundings are absolute
F32_LARGEST = float(np.finfo(np.float32).max)


def fp8_spacing(t, kind: str) -> np.ndarray:
    """The spacing of the fp8 format ``kind``'s values at t > 0, subnormals included:
    2^(max(floor(log2 t), emin) - m)."""
    m, emin, _ = FP8[kind]
    return np.exp2(np.maximum(np.floor(np.log2(t)), emin) - m)


def fp8_rounding(values, kind: str, per_row: bool) -> np.ndarray:
    """Per element, a bound on |x - x^| for x^ = s q, q = fp8(x / s), s = a / M in float32, a = max |x|
    over the scale's group (a row along the last axis, or the whole tensor), M the format's largest:

        |x - x^| <= ((1 + u)^3 - 1) |x| + s (1 + v) ulp(t) / 2 + (1 + s (1 + v)) 2^-149,
        t = min(M, (|x| (1 + u)^3 + 2^-149) / (s (1 - v))),

    u float32's unit roundoff, v = 2 u + u^2, ulp(t) the fp8 spacing at t (2^(max(floor(log2 t), emin)
    - m), m significand bits after the point, emin the smallest normal exponent: subnormals included).
    The engine takes x in float32 (within u, and 2^-150 below float32's normal range), forms s' (a in
    float32, then the quotient: within v s of s) and t' = x / s' in float32 (a quotient, or an inverse and
    a product: (1 + u)^3 with x's rounding, plus 2^-150 where t' is subnormal in float32), and q the
    nearest fp8 to t': x - s' q = (x - s' t') + s' (t' - q), |t' - q| at most half the fp8 spacing at
    |t'| <= t.  The GEMM multiplies by s' itself (float32), so no stored scale rounds.  |t'| passes M by
    at most (1 + u)^3 / (1 - v), far below the next value's half-way point (464 for e4m3, 61440 for
    e5m2): dynamic scaling never saturates.  An element 0 is exact (t' = 0), and so is a group of zeros
    (an engine scales it by anything finite).  Below float32's normal range s' rounds absolutely: a scale
    under 2^-126 (a < M 2^-126) has no relative bound, and a group past float32's range (a float64 x)
    is inf in float32: both are inf here."""
    _, _, largest = FP8[kind]
    x = np.abs(np.asarray(values, dtype=np.float64))
    a = x.max(axis=-1, keepdims=True) if per_row else np.full((1,) * x.ndim, x.max(initial=0.0))
    s = a / largest
    u = U32
    v = 2 * u + u * u
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.minimum(largest, (x * (1 + u) ** 3 + F32_SUBNORMAL) / (s * (1 - v)))
        spacing = fp8_spacing(t, kind)
    bound = ((1 + u) ** 3 - 1) * x + s * (1 + v) * spacing / 2 + (1 + s * (1 + v)) * F32_SUBNORMAL
    bound = np.where(x == 0, 0.0, bound)
    return np.where(((s > 0) & (s < 2.0**-126)) | (a > F32_LARGEST), np.inf, bound)


def input_rounding(x, name: str) -> np.ndarray:
    """Per element, the bound on |x - x^| of the declared activation format ``name``."""
    if name in FP8_ACTIVATIONS:
        return fp8_rounding(x, *FP8_ACTIVATIONS[name])
    return activation_rounding(x, name)


def _rounded_magnitude(x, activations):
    """|x^_k| <= |x_k| + |x_k - x^_k|: the activations a rounded W meets (x itself where none are declared)."""
    return np.abs(x) + input_rounding(x, activations) if activations else np.abs(x)


def declared_weights(args, dtype, name, activations=None):
    """linear and gate_up with W held in an fp8 format: W x - W^ x^ = W (x - x^) + (W - W^) x^, the first
    the activations' term, the second at most T = sum_k |W_nk - W^_nk| |x^_k| (this term); the scale at
    (W^, x^) is at most the scale at (W, x) plus both.  A checkpoint's block format (q8_0, ...) has no
    term: the reference runs on its exact values (None)."""
    if name not in FP8_WEIGHTS:
        return None
    *weights, x = args
    rounded = _rounded_magnitude(x, activations)
    term = np.concatenate([rounded @ fp8_rounding(W, *FP8_WEIGHTS[name]).T for W in weights], axis=-1)
    return term, term


def lm_head_declared_weights(args, dtype, name, activations=None):
    """lm_head with W held in an fp8 format: the logit moves by declared_weights' T beyond the
    activations' move (the cap's slope taken at both), y by |mul| T."""
    if name not in FP8_WEIGHTS:
        return None
    mul, cap, W, x = args
    before = _moved(W, x, activations) if activations else 0.0
    moved = _rounded_magnitude(x, activations) @ fp8_rounding(W, *FP8_WEIGHTS[name]).T
    return _lm_head_moved(mul, cap, W, x, dtype, moved, before)


# ---- A declared KV cache format: what storing k and v in fp8 adds to the attention ops ----------------



def kv_cache_rounding(x, name: str, scale: float, dtype) -> np.ndarray:
    """Per element, a bound on |x - x^| for x stored as c = fp8(x / scale) and read back as x^ = c * scale
    rounded to D (the dtype under test), ``scale`` a float32 (adapters.kv_cache_format):

        |x - x^| <= w |x| + scale h(t) + u_D scale (t + h(t)),   t = |x| (1 + w) / scale,

    w = (1 + u)^3 - 1 (u float32's unit roundoff) and h(t) = 2^(max(floor(log2 t), emin) - p), half the
    fp8 spacing at t: p the format's significant bits, emin its smallest normal exponent (below 2^emin,
    h is half the subnormal spacing, times the scale).  The engine forms t' = x / scale in float32 (x to
    float32, the inverse scale and the product round once each: |t' - x / scale| <= w |x| / scale, so
    |t'| <= t), rounds t' to the nearest fp8 value c (|c - t'| <= h(|t'|) <= h(t), h growing with t) and
    multiplies back: x - c scale = scale (x / scale - t') + scale (t' - c), and the product c scale rounds
    once in D (|c| <= t + h(t); exact in float64).  The scale is what the engine holds, the declared
    number rounded to float32: no rounding of its own.  Where t reaches the format's largest value plus
    half its spacing there, t' may round past it (e4m3fn's NaN, e5m2's inf, or a saturating engine's
    largest value): no bound (inf).  A zero is stored exactly."""
    kind = name.removeprefix("fp8_")
    largest = FP8[kind][2]
    x = np.abs(np.asarray(x, dtype=np.float64))
    w = (1 + U32) ** 3 - 1
    t = x * (1 + w) / scale * (1 + 2.0**-50)  # the float64 quotient rounded up: t stays an upper bound
    half = np.where(x > 0, fp8_spacing(np.where(t > 0, t, 1.0), kind) / 2, 0.0)
    bound = w * x + scale * half + format_of(dtype).eps * scale * (t + half)
    return np.where(t >= largest + fp8_spacing(largest, kind) / 2, np.inf, bound)


def _kv_cache_attention(scale, visible, q, k, v, dtype, name):
    """What a KV cache stored in the declared format adds to both tiers: (tier 1's scale increase, its
    term, tier 2's scale increase, its term).

    With |k_le - k^_le| <= e_le and |v_ld - v^_ld| <= f_ld (kv_cache_rounding), each logit moves by at
    most d_l = |scale| sum_e |q_e| e_le (0 where masked); let d* = sum_j p_j d_j and d_max = max_l d_l.
    The rounded logits' weights are p^_l = p_l e^(D_l) / Z, |D_l| <= d_l, Z = sum_j p_j e^(D_j) >= e^(-d*)
    (Jensen), so p^_l <= p_l e^(d_l + d*).  With o the exact output, sum_l (p^_l - p_l) = 0 gives

        o^ - o = sum_l p^_l (v^_l - v_l) + sum_l (p^_l - p_l)(v_l - o)
               = sum_l p^_l (v^_l - v_l) + sum_l p_l (e^(D_l) - 1)(v_l - o) / Z,

    so |o^ - o| <= T = e^(d*) sum_l p_l e^(d_l) f_l + e^(d*) sum_l p_l (e^(d_l) - 1) |v_l - o|, the term
    of both tiers: to first order sum_l p_l (f_l + d_l |v_l - o|), which D_l = d_l sign(v_l - o) and
    v^_l - v_l = f_l reach.  The weights p^_l sum to 1, so neither part exceeds its largest value over
    the visible keys, max f_l and max |v_l - o|: where the logits move by more than a few units, those
    caps are the bound.  The engine's own roundings are each tier's model at the rounded cache,
    which grows with p_l, |v_l|, |z_l| and a_l (|scale| sum_e |q_e k_le|): at most min(1, p_l e^(d_l + d*)),
    |v_l| + f_l, |z_l| + d_l + d_max (the largest logit moves by d_max at most) and a_l + d_l.  Each
    tier's model there, minus its model at the exact cache, is its increase: the scale's, and the
    absolute allowance's, added to T.  Values past the format's range: no bound (inf)."""
    fmt, k_scale, v_scale = kv_cache_format(name)
    e, f = kv_cache_rounding(k, fmt, k_scale, dtype), kv_cache_rounding(v, fmt, v_scale, dtype)
    p, z, magnitudes, mask = _logits(scale, visible, q, k)
    shape = p.shape[:-1] + (v.shape[-1],)
    if not (np.isfinite(e).all() and np.isfinite(f).all()):
        unbounded = np.full(shape, np.inf)
        return unbounded, unbounded, unbounded, unbounded
    moved = np.where(mask, abs(scale) * head_logits(np.abs(q), e), 0.0)
    mean_moved = np.sum(p * moved, axis=-1, keepdims=True)
    o = head_sums(p, v)
    rows = (-1, p.shape[-1])
    heads = np.broadcast_to(np.arange(p.shape[1])[None, :, None], p.shape[:-1]).reshape(-1)
    highest, lowest = (_over_visible(reduce, visible, v) for reduce in (np.max, np.min))
    farthest = np.broadcast_to(np.maximum(highest - o, o - lowest), shape).reshape(-1, shape[-1])  # max |v_l - o|
    moves = moved_logits_term(p.reshape(rows), moved.reshape(rows), v, heads, o.reshape(-1, shape[-1]),
                              farthest).reshape(shape)
    largest_f = _over_visible(np.max, visible, f)
    with np.errstate(over="ignore"):  # an inf is a bound the cap replaces
        growth = np.exp(np.minimum(mean_moved, 700))
        term = np.minimum(growth * head_sums(p * np.exp(np.minimum(moved, 700)), f), largest_f) + moves
    with np.errstate(divide="ignore"):
        weights = np.exp(np.minimum(np.log(p) + moved + mean_moved, 0.0))
    at_rounded = (weights, np.abs(z) + moved + np.max(moved, axis=-1, keepdims=True),
                  magnitudes + moved, mask, np.abs(v) + f, visible, dtype)
    at_exact = (p, z, magnitudes, mask, np.abs(v), visible, dtype)
    parts = []
    for model in (_plain_model, _in_accumulation_model):
        (scale_there, absolute_there), (scale_here, absolute_here) = model(*at_rounded), model(*at_exact)
        parts += [np.maximum(scale_there - scale_here, 0.0), term + np.maximum(absolute_there - absolute_here, 0.0)]
    return tuple(parts)


def moved_logits_term(p, moved, v, heads, o, cap):
    """How far the output o = sum_l p_l v_l of softmax weights p moves when each logit moves by at most d_l
    (``moved``): e^(d*) sum_l p_l (e^(d_l) - 1) |v_l - o|, d* = sum_j p_j d_j (_kv_cache_attention
    derives it), and at most ``cap`` [R, D] (the moved weights sum to 1 too: a bound on how far apart
    two averages of the visible values lie).  Per row r: p and moved [R, L], the KV head ``heads`` [R]
    that reads v [L, Hkv, D], and o [R, D]; an output that is not a number has no bound: inf."""
    weighted = p * np.expm1(np.minimum(moved, 700))  # past e^700 the cap holds the bound
    growth = np.exp(np.minimum(np.sum(p * moved, axis=-1), 700))
    spread = np.zeros(o.shape)
    _spread(*(np.ascontiguousarray(x) for x in (weighted, heads, v, o)), spread)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.minimum(growth[:, None] * spread, cap)
    return np.where(np.isnan(out), np.inf, out)


@jit
def _spread(weighted, heads, v, o, out):
    """out[r, d] = sum_l weighted[r, l] |v[l, heads[r], d] - o[r, d]| over the keys l whose weight is not 0
    (a logit that does not move costs nothing)."""
    for r in range(weighted.shape[0]):
        c = heads[r]
        for l in range(weighted.shape[1]):
            w = weighted[r, l]
            if w != 0:
                for d in range(v.shape[2]):
                    out[r, d] += w * abs(v[l, c, d] - o[r, d])


def _over_visible(reduce, visible, x):
    """``reduce`` (np.max, np.min) of x [L, Hkv, D] over each query's visible keys: [S, Hkv, 1, D], 0 for a
    query that sees none."""
    return np.stack([reduce(x[row], axis=0) if row.any() else np.zeros(x.shape[1:]) for row in visible])[:, :, None, :]


def _per_op_kv_cache(inputs, name):
    def declared(args, dtype, format_name):
        return tuple(inputs.output(part) for part in _kv_cache_attention(*inputs(args), dtype, format_name))

    declared.__name__ = f"{name}_kv_cache"
    return declared


causal_gqa_kv_cache, sliding_gqa_kv_cache, decode_gqa_kv_cache = (
    _per_op_kv_cache(inputs, name) for inputs, name in _INPUTS)
