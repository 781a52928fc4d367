"""Enclosures: each op's exact result as ``mid ± rad`` on whole arrays, in a fast floating format.

The judging's first stage (Ziv's strategy, as in CRlibm and CORE-MATH): the oracles stay the
definition, and an element goes to them only where an enclosure cannot decide its verdict
(``properties/judging.py``).  One function per oracle, with its name and argument order, each
returning ``(mid, rad)`` with ``|exact - mid| <= rad`` elementwise.  rad is inf where this stage does
not bound the result (a non-finite input, an intermediate out of the format's range), and 0 only
where the result is exactly ``mid`` (masked entries, zero sums).  An op without a function here
(``inv_freq``: a handful of elements) is always judged by its oracle.

The format ``work`` is float64 for the targets of at most 24 bits and ``np.longdouble`` for float64.
For the narrow targets every function other than the products runs as one compiled loop per element
(``spec.compiled``, the formula its docstring here derives).  For float64 every op but the products
(``DOUBLE_WORD``) gives its mid as a ``DoubleWord``, high + low, from compiled double-word arithmetic
whose bounds are derived beside its kernels in ``spec.compiled`` (2^-70 of the result or less, rope's
2^-76 of its inputs' magnitude, attention's 2^-75 of sum_l p_l |v_l|: far inside float64's ULP); the
products linear, gate_up and lm_head stay in numpy's long double (the 80-bit format on x86, 11 bits past
float64; where longdouble is float64 the radii come out about one float64 ULP and the oracle decides more)
around their double-double sums.  Each bound is derived beside its function in units of ``u``, ``work``'s unit
roundoff (every + - * / and sqrt rounds once, relative error <= u), and ``ELEMENTARY``, the relative
error allowed to one call of exp, tanh, sin, cos or pow.  First-order terms are summed and the total
is multiplied by ``MARGIN`` for the second-order ones.  Results that may underflow carry an absolute
part (a multiple of the smallest normal number) times their factors.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import NamedTuple

import mpmath
import numpy as np

from . import compiled
from .exact import double_double_dots, double_double_radius, dots_enclosure, widened


class NotEnclosed(Exception):
    """This stage does not take these arguments (a real that is not a float, a zero divisor): the
    oracle judges the whole example."""


def work_type(precision: int):
    """The floating type of the enclosures for a target of ``precision`` significand bits."""
    return np.float64 if precision <= 24 else np.longdouble


# Relative error of one elementary function call, in units of u: numpy's float64 exp, tanh, sin, cos
# and pow, and glibc's long double ones, err by at most 1 to 3 ULPs (2u to 6u) on their documented and
# measured worst cases (tests/test_enclosures.py measures them against mpmath); twice that is allowed.
ELEMENTARY = 12
MARGIN = 1 + 2.0**-20
_E64, _MARGIN64 = compiled.constants(ELEMENTARY, MARGIN)  # the compiled kernels' (float64)


def _flat(x) -> np.ndarray:
    """A floating array as the compiled kernels take it: float64 (exact), contiguous, flat."""
    return np.ascontiguousarray(widened(np.asarray(x)), dtype=np.float64).reshape(-1)


def _compiled(kernel, shape, *args):
    """A compiled kernel's (mid, rad) of the given shape."""
    mid, rad = np.empty(shape), np.empty(shape)
    kernel(*args, mid.reshape(-1), rad.reshape(-1))
    return mid, rad


class DoubleWord(NamedTuple):
    """A float64 target's mid as the unevaluated sum high + low of two float64 arrays: the double-word
    kernels of ``spec.compiled``, whose radii lie far inside float64's ULP (long double's 11 more bits
    leave the largest error's printed digits to the oracle)."""

    high: np.ndarray
    low: np.ndarray


def _double_word(kernel, shape, *args) -> tuple[DoubleWord, np.ndarray]:
    """A double-word kernel's (DoubleWord mid, rad) of the given shape."""
    high, low, rad = np.empty(shape), np.empty(shape), np.empty(shape)
    kernel(*args, high.reshape(-1), low.reshape(-1), rad.reshape(-1))
    return DoubleWord(high, low), rad


class _Work:
    """The floating type in use and its constants."""

    def __init__(self, work):
        self.type = work
        info = np.finfo(work)
        self.u = work(info.eps) / 2
        self.tiny = work(info.smallest_normal)
        self.elementary = ELEMENTARY * self.u

    def array(self, x) -> np.ndarray:
        """A floating array in ``work``, exactly (every format under test widens exactly to float64)."""
        return widened(np.asarray(x)).astype(self.type)

    def real(self, r):
        """A real argument (eps, theta, scale, ...) in ``work``, exactly, or NotEnclosed."""
        if isinstance(r, bool) or not isinstance(r, (float, int, np.floating, np.integer)):
            raise NotEnclosed(f"a real argument of type {type(r).__name__}")
        try:
            value = self.type(r)
        except OverflowError:
            raise NotEnclosed(f"the real {r!r} is out of {self.type.__name__}'s range") from None
        if not np.isfinite(value) or Fraction(float(value)) != Fraction(r):
            raise NotEnclosed(f"the real {r!r} is not exact in {self.type.__name__}")
        return value

    def rad(self, mid, relative, absolute=0.0) -> np.ndarray:
        """relative * |mid| + absolute, with the margin, inf where mid is not finite."""
        with np.errstate(over="ignore", invalid="ignore"):
            r = (relative * np.abs(mid) + absolute) * self.type(MARGIN)
        return np.where(np.isfinite(mid), r, np.inf).astype(self.type)


def sigmoid(x, *, work):
    """1 / (1 + exp(-x)) and its relative error: exp errs by E, 1 + e passes on at most e/(1 + e) <= 1
    of it and rounds (u), the quotient rounds (u).  Where exp(-x) overflows the result is 0 within
    1 / max <= tiny; where it underflows, 1 + e is off by at most tiny.  For float64 (every op with a
    sigmoid): a double word, ``compiled._sigmoid_double_word``."""
    if work is np.float64:
        return _compiled(compiled.sigmoid, np.shape(x), _flat(x), _E64, _MARGIN64)
    return _double_word(compiled.sigmoid_double_word, np.shape(x), _flat(x), _MARGIN64)


def silu(x, *, work):
    """x sigmoid(x): one more rounding; sigmoid's absolute part scaled by |x|."""
    if work is np.float64:
        return _compiled(compiled.silu, np.shape(x), _flat(x), _E64, _MARGIN64)
    return _double_word(compiled.silu_double_word, np.shape(x), _flat(x), _MARGIN64)


# sqrt(2/pi) and 0.044715 in float64, each rounded once from the real constant.
_GELU_K, _GELU_A = math.sqrt(2 / math.pi), 0.044715


def gelu_tanh(x, *, work):
    """x / (1 + exp(t)), t = -2 k (x + a x^3), as the oracle evaluates it.  x + a x^3 adds terms of one
    sign: x^2, x^3, a x^3 (a rounded: 4u) and the sum (5u); k rounded and the products (7u) make t's
    relative error, which exp turns into |t| 7u relative, plus its own E, of which 1 + e keeps the
    part e / (1 + e); 1 + e and the quotient round (2u).  Where exp overflows, the result is 0 within |x|
    / max (``compiled._gelu``).  For float64: a double word, ``compiled._gelu_double_word``."""
    if work is np.float64:
        return _compiled(compiled.gelu_tanh, np.shape(x), _flat(x), _GELU_K, _GELU_A, _E64, _MARGIN64)
    return _double_word(compiled.gelu_tanh_double_word, np.shape(x), _flat(x), _MARGIN64)


def softcap(c, x, *, work):
    """c tanh(x / c): x / c rounds (u), tanh's condition |q tanh'(q) / tanh(q)| is at most 1, tanh errs
    by E, the product rounds (u).  x / c may underflow: |c| tiny.  For float64: a double word,
    ``compiled.softcap_double_word``."""
    c = _Work(np.float64).real(c)
    if c == 0:
        raise NotEnclosed("softcap with c = 0")
    if work is np.float64:
        return _compiled(compiled.softcap, np.shape(x), c, _flat(x), _E64, _MARGIN64)
    return _double_word(compiled.softcap_double_word, np.shape(x), c, _flat(x), _MARGIN64)


def _mean_square_root(w: _Work, eps, x, mean: bool):
    """sqrt(sum_j x_j^2 / H + eps) (or without / H) and its relative error: the exact sum's (s), / H
    and + eps round (2u, the terms are >= 0), sqrt halves what it is given and rounds (u)."""
    eps = w.real(eps)
    if eps < 0:
        raise NotEnclosed("a negative eps")
    H = x.shape[-1]  # targets of at most 24 bits: their squares are exact in float64
    squares, rad = _compiled(compiled.sums_of_squares, x.shape[:-1], _flat(x), H, _MARGIN64)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = np.where(squares > 0, rad / squares, np.where(rad > 0, np.inf, 0))
        total = (squares / H if mean and H else squares) + eps  # H = 0: the empty sum 0, and Lean's 0 / 0 = 0
        rel = (s + 2 * w.u) / 2 + w.u
    if np.any(total == 0):
        raise NotEnclosed("a zero norm (Lean's x / 0 = 0, the oracle's definition)")
    return np.sqrt(total), rel


def _root_double_word(eps, x, mean: bool):
    """``compiled.root_double_word``'s (high, low, relative error) per row."""
    eps = _Work(np.float64).real(eps)
    if eps < 0:
        raise NotEnclosed("a negative eps")
    high, low, rel = (np.empty(x.shape[:-1]) for _ in range(3))
    compiled.root_double_word(_flat(x), x.shape[-1], mean, eps, high.reshape(-1), low.reshape(-1), rel.reshape(-1))
    if np.any(high == 0):
        raise NotEnclosed("a zero norm (Lean's x / 0 = 0, the oracle's definition)")
    return high, low, rel


def rms(eps, x, *, work):
    if work is not np.float64:
        high, low, rel = _root_double_word(eps, np.asarray(x), True)
        return DoubleWord(high, low), np.where(np.isfinite(rel), rel * high * MARGIN, np.inf)
    w = _Work(work)
    y, rel = _mean_square_root(w, eps, x, True)
    return y, w.rad(y, rel)


def _row_weights(w, x):
    """A norm's weights as its kernels take them: (flat, the step between rows: 0 where one row is for all)."""
    H = x.shape[-1]
    if w is None or np.shape(w) == (H,):
        return _flat(np.zeros(0) if w is None else w), 0
    return _flat(np.broadcast_to(w, x.shape)), H


def _normalised_compiled(eps, x, kind, w=None, z=None, mean=True, *, work):
    """x / rms per row (one more rounding of the root's relative error), times the factor of ``kind``:
    ``compiled.normalised`` for the narrow targets, and ``compiled.normalised_double_word`` for float64
    (``work`` long double)."""
    x = np.asarray(x)
    weights, step = _row_weights(w, x)
    gate = _flat(np.zeros(0) if z is None else np.broadcast_to(z, x.shape))
    if work is not np.float64:
        high, low, rel = _root_double_word(eps, x, mean)
        return _double_word(compiled.normalised_double_word, x.shape, _flat(x), x.shape[-1], _flat(high), _flat(low),
                            _flat(rel), kind, weights, step, gate, _MARGIN64)
    root, rel = _mean_square_root(_Work(np.float64), eps, x, mean)
    return _compiled(compiled.normalised, x.shape, _flat(x), x.shape[-1], _flat(root), _flat(rel), kind, weights, step,
                     gate, _E64, _MARGIN64)


def rmsnorm(eps, x, w, *, work):
    return _normalised_compiled(eps, x, 1, w, work=work)


def rmsnorm_offset(eps, x, w, *, work):
    """(1 + w) rounds once (u, relative to itself whatever the cancellation), the product (u)."""
    return _normalised_compiled(eps, x, 2, w, work=work)


def rmsnorm_unit(eps, x, *, work):
    return _normalised_compiled(eps, x, 0, work=work)


def rmsnorm_gated(eps, x, z, w, *, work):
    """w (x / rms) silu(z): silu's relative error and absolute part, two more roundings."""
    return _normalised_compiled(eps, x, 3, w, z, work=work)


def l2norm(eps, x, *, work):
    return _normalised_compiled(eps, x, 0, mean=False, work=work)


def rope(theta, rot, denom, active, pos, x, *, work):
    """Rotate-half RoPE.  The inverse frequency theta^(-2i/denom): the exponent rounds (u), which moves
    the power by |exponent ln theta| u, and pow errs by E; the angle a = pos w rounds (u).  cos and sin
    of the rounded angle are off by at most |a| times its relative error (their slopes are <= 1) plus
    E; each of the two products and the difference rounds: the bound is absolute, scaled by |x_d| +
    |x_p| and the products' magnitudes, since the difference may cancel.  For float64: double words,
    ``compiled.rope_double_word``."""
    theta = _Work(np.float64).real(theta)
    if theta <= 0 or denom == 0:
        raise NotEnclosed("theta <= 0 or denom = 0")
    x = np.asarray(x)
    D = x.shape[-1]
    half = rot // 2
    positions = _flat(np.asarray(pos).astype(np.float64))
    if work is not np.float64:  # float64: double words (``compiled.rope_double_word``)
        high, low = _rope_frequencies_double_word(theta, denom, active, min(half, D))
        return _double_word(compiled.rope_double_word, x.shape, _flat(x), D, half, positions, high, low, _MARGIN64)
    freqs, rel_freqs = _rope_frequencies(theta, denom, active, min(half, D))
    return _compiled(compiled.rope, x.shape, _flat(x), D, half, positions, freqs, rel_freqs, _E64, _MARGIN64)


@functools.lru_cache(maxsize=64)
def _rope_frequencies(theta, denom, active, n):
    """``rope``'s n inverse frequencies in float64 (0 past ``active``) and their relative errors: the same
    for every call of a model's rope."""
    w = _Work(np.float64)
    log_theta = abs(float(np.log(theta)))
    freqs, rel_freqs = np.zeros(n), np.zeros(n)
    for i in range(min(n, active)):
        exponent = -(2 * w.type(i) / w.type(denom))
        freqs[i] = np.power(theta, exponent)
        rel_freqs[i] = w.elementary + w.u + abs(float(exponent)) * log_theta * w.u * 2
    freqs.flags.writeable = rel_freqs.flags.writeable = False
    return freqs, rel_freqs


@functools.lru_cache(maxsize=64)
def _rope_frequencies_double_word(theta, denom, active, n):
    """``rope``'s n inverse frequencies theta^(-2i / denom) (0 past ``active``) as double words, each
    within u^2 of itself (rounded to nearest from 200 bits, mpmath)."""
    high, low = np.zeros(n), np.zeros(n)
    with mpmath.workprec(200):
        for i in range(min(n, active)):
            value = mpmath.power(mpmath.mpf(theta), -mpmath.mpf(2 * i) / denom)
            high[i] = float(value)
            low[i] = float(value - mpmath.mpf(high[i]))
    high.flags.writeable = low.flags.writeable = False
    return high, low


def rope_std(theta, rot, pos, x, *, work):
    return rope(theta, rot, rot, rot // 2, pos, x, work=work)


def linear(W, x, *, work):
    """The products' enclosure (``spec.exact.dots_enclosure``: float64 BLAS and its a-priori bound, or
    for float64 operands the exact sums)."""
    return dots_enclosure(np.asarray(x), np.asarray(W), work)


def gate_up(Wg, Wu, x, *, work):
    (g, rg), (u, ru) = linear(Wg, x, work=work), linear(Wu, x, work=work)
    return np.concatenate([g, u], axis=-1), np.concatenate([rg, ru], axis=-1)


def _halves(gu):
    I = gu.shape[-1] // 2
    return gu[..., :I], gu[..., I:]


def silu_mul(gu, *, work):
    """silu(gate) up: silu's bound and one more rounding."""
    gate, up = _halves(np.asarray(gu))
    if work is np.float64:
        return _compiled(compiled.silu_mul, gate.shape, _flat(gate), _flat(up), _E64, _MARGIN64)
    return _double_word(compiled.silu_mul_double_word, gate.shape, _flat(gate), _flat(up), _MARGIN64)


def gelu_mul(gu, *, work):
    gate, up = _halves(np.asarray(gu))
    if work is np.float64:
        return _compiled(compiled.gelu_mul, gate.shape, _flat(gate), _flat(up), _GELU_K, _GELU_A, _E64, _MARGIN64)
    return _double_word(compiled.gelu_mul_double_word, gate.shape, _flat(gate), _flat(up), _MARGIN64)


def residual(r, x, h, *, work):
    """x + r h: the product and the sum round (the sum's error relative to the result; the product's
    to |r h|, since the sum may cancel it)."""
    r = _Work(np.float64).real(r)
    x, h = np.broadcast_arrays(np.asarray(x), np.asarray(h))
    if work is np.float64:
        return _compiled(compiled.residual, x.shape, r, _flat(x), _flat(h), _MARGIN64)
    return _double_word(compiled.residual_double_word, x.shape, r, _flat(x), _flat(h), _MARGIN64)


def embed(c, E, tokens, *, work):
    """c E[token]: one rounding in the narrow targets; for float64 exact as a double word."""
    c = _Work(np.float64).real(c)
    rows = np.asarray(E)[np.asarray(tokens)]
    if work is np.float64:
        return _compiled(compiled.scaled, rows.shape, c, _flat(rows), _MARGIN64)
    return _double_word(compiled.scaled_double_word, rows.shape, c, _flat(rows))


def lm_head(mul, cap, W, x, *, work):
    """mul times the exact sum (u), then softcap as ``softcap``, whose argument's relative error tanh
    passes on at most once."""
    w = _Work(work)
    mul = w.real(mul)
    logit, rad = linear(W, x, work=work)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(logit != 0, rad / np.abs(logit), np.where(rad > 0, np.inf, 0))
    y = mul * logit
    rel = rel + w.u
    if cap is not None:
        cap = w.real(cap)
        if cap == 0:
            raise NotEnclosed("lm_head with cap = 0")
        y = cap * np.tanh(y / cap)
        rel = rel + w.elementary + 3 * w.u
    return y, w.rad(y, rel, 2 * w.tiny * (1 + abs(mul)) * (2 + (abs(cap) if cap is not None else 0)))


def _softmax(s, s_rad, visible):
    """Weights p and their relative errors per row (``compiled.softmax``), float64: z = s - max rounds (u |z|)
    and carries the logits' own radii; exp turns z's absolute error into a relative one and errs by E; the
    sum of L nonnegative terms errs by (L - 1) u plus its terms' largest relative error; the quotient
    rounds.  Underflowed terms are off by at most tiny (the sum is >= 1)."""
    L = s.shape[-1]
    p, rel = np.empty(s.shape), np.empty(s.shape)
    if s.size:
        compiled.softmax(_flat(s), _flat(np.broadcast_to(s_rad, s.shape)),
                         np.ascontiguousarray(np.broadcast_to(visible, s.shape)).reshape(-1), L, _E64,
                         p.reshape(-1), rel.reshape(-1))
    return p, rel


def softmax(s, visible, *, work):
    """``_softmax``'s weights; for float64 double words (``compiled.softmax_double_word``)."""
    visible = np.broadcast_to(np.asarray(visible, dtype=bool), np.shape(s))
    if work is not np.float64:
        if not np.size(s):
            return DoubleWord(np.zeros(np.shape(s)), np.zeros(np.shape(s))), np.zeros(np.shape(s))
        return _double_word(compiled.softmax_double_word, np.shape(s), _flat(s), np.zeros(0), np.zeros(0),
                            np.ascontiguousarray(visible).reshape(-1), np.shape(s)[-1], _MARGIN64)
    s = _flat(s)
    p, rad = np.empty(visible.shape), np.empty(visible.shape)
    if s.size:
        compiled.softmax_enclosure(s, np.ascontiguousarray(visible).reshape(-1), visible.shape[-1], _E64,
                                   2 * _Work(work).tiny, _MARGIN64, p.reshape(-1), rad.reshape(-1))
    return p, rad


def _seen(visible, k, v):
    """Keys no query sees weigh exactly 0: they are left out (where none is seen, every row is masked whole:
    nothing to leave out)."""
    seen = visible.any(axis=0)
    if seen.any() and not seen.all():
        return visible[:, seen], k[seen], v[seen]
    return visible, k, v


def _gqa(scale, visible, q, k, v, work):
    """Softmax of the logits' enclosure (``dots_enclosure`` times scale, one more rounding) and the weighted
    sum of values p @ v by float64 BLAS: its error is at most L u sum_l p_l |v_l| in any order (gamma_L, its
    roundings inside MARGIN), plus each weight's relative error times p_l |v_l|, both sums by BLAS too.  L
    counts the keys some query sees (``_seen``).  A float64 target's: ``_gqa_double_word``."""
    if work is not np.float64:
        return _gqa_double_word(scale, visible, q, k, v)
    w = _Work(work)
    scale = w.real(scale)
    visible, k, v = _seen(visible, k, v)
    wide = widened(np.asarray(v))
    out = np.empty(q.shape)
    rad = np.empty(q.shape)
    L = k.shape[0]
    mask = visible[:, None, :]
    for c in range(q.shape[1]):
        dot, dot_rad = dots_enclosure(q[:, c], k[:, c], w.type, kept=False)  # [S, G, L]
        logits = scale * dot
        logits_rad = abs(scale) * dot_rad + w.u * np.abs(logits)
        p, rel = _softmax(logits, logits_rad, mask)
        values = wide[:, c]
        magnitudes = np.abs(values)
        total = magnitudes.sum(axis=0) * (1 + L * 2.0**-52)  # above sum_l |v_l|
        out[:, c] = p @ values
        rad[:, c] = (rel * p) @ magnitudes + (L + 2) * w.u * (p @ magnitudes) + 2 * w.tiny * (1 + total)
    return out, w.rad(out, 0.0, rad)


def _upper_products(a, b):
    """Above a @ b for nonnegative float64 a [..., L] and b [L, D], by float64 BLAS: each product and sum of
    nonnegatives loses at most u relative, (L + 1) u in all in any order, and a product that underflows less
    than 2^-1074: the computed sum plus 2^-1074 L, times 1 + (L + 4) 2^-52 (which also holds its own two
    roundings and 2 u more for its callers), is above."""
    L = a.shape[-1]
    return (a @ b + 2.0**-1074 * L) * (1 + (L + 4) * 2.0**-52)


def _weighted_sums_factor(L: int) -> float:
    """F: F sum_l p_l |v_l| bounds the error of ``compiled.weighted_sums``' double word over L terms (gamma_L^2
    and L 2^-104), rounded up."""
    u = Fraction(1, 2**53)
    gamma = L * u / (1 - L * u)
    return math.nextafter(float(gamma**2 + L * Fraction(1, 2**104)), math.inf)


def _gqa_double_word(scale, visible, q, k, v):
    """A float64 target's attention as double words.  The logits: the dot products' double-double sums
    (``exact.double_double_dots``, within ``exact.double_double_radius``) times the scale
    (``compiled.scaled_sums_double_word``).  Their weights (``compiled.softmax_double_word``, which carries
    the logits' radii) and the weighted sums of values (``compiled.weighted_sums``, within F sum_l p_l |v_l|,
    ``_weighted_sums_factor``, and 2^-1071 (L + sum_l |v_l|) for its underflow).  The weights' radii r_l add
    sum_l r_l |v_l|.  Both sums are one ``_upper_products`` (whose slack holds the rounding of r_l + F p_l
    and what p_high leaves out of p = p_high + p_low, normalised).  Heads with a value past 2^995 or not
    finite (the double-double sums could overflow), and rows whose logits' radius passes 2^-20: inf."""
    scale = float(_Work(np.float64).real(scale))
    visible, k, v = _seen(visible, k, v)
    q, k, v = (np.asarray(widened(np.asarray(a)), dtype=np.float64) for a in (q, k, v))
    S, H, G, D = q.shape
    L = k.shape[0]
    shape = (S, H, G, v.shape[-1])
    high, low, rad = np.empty(shape), np.empty(shape), np.empty(shape)
    mask = np.ascontiguousarray(np.broadcast_to(visible[:, None, :], (S, G, L))).reshape(-1)
    factor = _weighted_sums_factor(L)
    for c in range(H):
        values = np.ascontiguousarray(v[:, c])
        magnitudes = np.abs(values)
        if not magnitudes.max(initial=0.0) <= 2.0**995:
            high[:, c], low[:, c], rad[:, c] = np.nan, 0.0, np.inf
            continue
        dot_high, dot_low, magnitude, _ = double_double_dots(q[:, c].reshape(S * G, D), k[:, c])
        dot_rad = double_double_radius(D, magnitude)
        s_high, s_low, s_rad = np.empty(S * G * L), np.empty(S * G * L), np.empty(S * G * L)
        compiled.scaled_sums_double_word(scale, dot_high.reshape(-1), dot_low.reshape(-1), dot_rad.reshape(-1),
                                         s_high, s_low, s_rad)
        p_high, p_low, p_rad = np.empty(S * G * L), np.empty(S * G * L), np.empty(S * G * L)
        if L:
            compiled.softmax_double_word(s_high, s_low, s_rad, mask, L, _MARGIN64, p_high, p_low, p_rad)
        p_high, p_low, p_rad = (a.reshape(S * G, L) for a in (p_high, p_low, p_rad))
        out_high, out_low = np.empty((S * G, values.shape[-1])), np.empty((S * G, values.shape[-1]))
        compiled.weighted_sums(p_high, p_low, values, out_high, out_low)
        total = magnitudes.sum(axis=0) * (1 + L * 2.0**-52)  # above sum_l |v_l|
        with np.errstate(invalid="ignore", over="ignore"):
            bound = _upper_products(p_rad + factor * p_high, magnitudes) + 2.0**-1071 * (L + total)
            bound = np.where(np.isfinite(bound) & np.isfinite(out_high), bound * (1 + 2.0**-50), np.inf)
        high[:, c], low[:, c], rad[:, c] = (a.reshape(S, G, -1) for a in (out_high, out_low, bound))
    return DoubleWord(high, low), rad


def causal_gqa(scale, pos, q, k, v, *, work):
    keys = np.arange(k.shape[0])[None, :]
    return _gqa(scale, keys <= np.asarray(pos)[:, None], q, k, v, work)


def sliding_gqa(scale, window, pos, q, k, v, *, work):
    keys, p = np.arange(k.shape[0])[None, :], np.asarray(pos)[:, None]
    return _gqa(scale, (keys <= p) & (p < keys + window), q, k, v, work)


def decode_gqa(scale, q, k, v, *, work):
    y, rad = _gqa(scale, np.ones((1, k.shape[0]), dtype=bool), q[None], k, v, work)
    return (DoubleWord(y.high[0], y.low[0]) if isinstance(y, DoubleWord) else y[0]), rad[0]


def sigmoid_gate(o, gate, *, work):
    o, gate = np.broadcast_arrays(np.asarray(o), np.asarray(gate))
    if work is np.float64:
        return _compiled(compiled.sigmoid_gate, o.shape, _flat(o), _flat(gate), _E64, _MARGIN64)
    return _double_word(compiled.sigmoid_gate_double_word, o.shape, _flat(o), _flat(gate), _MARGIN64)


# The ops whose float64 target's enclosure is a double word (the others' is long double).
DOUBLE_WORD = frozenset({"rms", "rmsnorm", "rmsnorm_offset", "rmsnorm_unit", "rmsnorm_gated", "l2norm", "residual",
                         "embed", "sigmoid", "silu", "silu_mul", "sigmoid_gate", "gelu_tanh", "gelu_mul",
                         "softcap", "softmax", "rope", "rope_std", "causal_gqa", "sliding_gqa", "decode_gqa"})

ENCLOSURES = {fn.__name__: fn for fn in (
    sigmoid, silu, gelu_tanh, softcap, rms, rmsnorm, rmsnorm_offset, rmsnorm_unit, rmsnorm_gated, l2norm,
    rope, rope_std, linear, gate_up, silu_mul, gelu_mul, residual, embed, lm_head, softmax, causal_gqa,
    sliding_gqa, decode_gqa, sigmoid_gate)}
