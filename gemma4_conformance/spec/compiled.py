"""The enclosures of ``spec.enclosures`` in float64, compiled: one loop per element (numba).

Each kernel evaluates its enclosure's formula (derived beside it in ``spec.enclosures``; for softcap,
rope and softmax also as numpy code for long double, with the same operations in the same order), on
flat float64 arrays, into the arrays ``mid`` and ``rad`` it is given (numpy's, which ask the kernel for
huge pages: writing numba's own new arrays cost more in page faults than the arithmetic).  Two bounds
differ from the derivations', each no smaller: an absolute part (what
results flushed below float64's smallest normal number lose, times the factors applied after) is 0 or at
least 2^-1021, so that no bound is a subnormal number (``_underflow``), and e^d - 1 for a small shift d
takes no expm1 (``_grown``).  numba compiles with IEEE semantics: no fastmath, so no reassociation and
no contraction into fused multiply-adds the bounds do not state; ``error_model="numpy"``, so a division
by zero gives inf or nan as numpy's does.  exp and tanh are LLVM's intrinsics, which call the C
library's (tests/test_enclosures.py measures them against mpmath, as it does numpy's).  Compiled code is
cached beside this file, or, where the package's folder is read-only (an installed wheel), in numba's
per-user cache folder (``NUMBA_CACHE_DIR`` overrides both).

The double-word kernels (``*_double_word``: the float64 target's enclosures of the ops in
``spec.enclosures.DOUBLE_WORD``) have no numpy counterpart; each states its bound beside it, from the
published bounds of the double-word operations it uses and of its exp.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

jit = numba.njit(cache=True, error_model="numpy")

U = 2.0**-53  # float64's unit roundoff
TINY = 2.0**-1022  # its smallest normal number


def constants(elementary: float, margin: float):
    """(E, MARGIN) of ``spec.enclosures`` for float64: E = ELEMENTARY u."""
    return elementary * U, margin


@jit
def widen_bfloat16(bits, out):
    """bf16 values, given as their uint16 bits (a 2-D array of any layout), into float64 ``out``: a
    bf16 is the top half of the float32 of the same value, which widens exactly (faster than ml_dtypes'
    cast, which was most of a product's judging at 2 rows)."""
    word = np.empty(1, dtype=np.uint32)
    value = word.view(np.float32)
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            word[0] = np.uint32(bits[i, j]) << np.uint32(16)
            out[i, j] = value[0]


@jit
def widen_by_table(bits, table, out):
    """16-bit values, given as their uint16 bits (a 2-D array of any layout), into float64 ``out``
    through ``table``, their 65536 values (faster than numpy's float16 cast)."""
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            out[i, j] = table[bits[i, j]]


@jit
def nan_max(a, b):
    """np.maximum: nan if either is nan."""
    if a != a or b != b:
        return a + b
    return a if a >= b else b


@jit
def _rad(mid, relative, absolute, margin):
    """relative |mid| + absolute, with the margin; inf where mid is not finite."""
    if not math.isfinite(mid):
        return math.inf
    return (relative * abs(mid) + absolute) * margin


@jit
def _underflow(factor):
    """2 TINY (1 + factor), 0 where factor is 0: what flushing a result below TINY loses, times the
    factors applied after it (``factor``), bounded so that its arithmetic meets no subnormal number
    (each costs the CPU about a hundred cycles, and the compiler may evaluate both sides of a branch)."""
    return 2 * TINY * (1 + factor) if factor != 0 else 0.0


@jit
def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


@jit
def sigmoid(x, E, margin, mid, rad):
    for i in range(x.size):
        y = _sigmoid(x[i])
        mid[i], rad[i] = y, _rad(y, E + 2 * U, 2 * TINY, margin)


@jit
def silu(x, E, margin, mid, rad):
    for i in range(x.size):
        y = x[i] * _sigmoid(x[i])
        mid[i], rad[i] = y, _rad(y, E + 2 * U + U, 2 * TINY * (1 + abs(x[i])), margin)


@jit
def _gelu(x, k, a, E):
    """(y, relative, the factor of the absolute part, ``_underflow``) of ``spec.enclosures.gelu_tanh`` for one x."""
    t = -2 * k * (x + a * (x * x * x))
    e = math.exp(t)
    y = x / (1 + e)
    passed = e / (1 + e) if math.isfinite(e) else 1.0
    rel = 2 * U + passed * (E + 7 * U * (abs(t) if math.isfinite(t) else 0.0))
    return y, rel, abs(x)


@jit
def gelu_tanh(x, k, a, E, margin, mid, rad):
    for i in range(x.size):
        y, rel, factor = _gelu(x[i], k, a, E)
        mid[i], rad[i] = y, _rad(y, rel, _underflow(factor), margin)


@jit
def softcap(c, x, E, margin, mid, rad):
    for i in range(x.size):
        y = c * math.tanh(x[i] / c)
        mid[i], rad[i] = y, _rad(y, E + 3 * U, 2 * TINY * (1 + abs(c)), margin)


@jit
def silu_mul(gate, up, E, margin, mid, rad):
    for i in range(gate.size):
        g = gate[i]
        y = g * _sigmoid(g) * up[i]
        mid[i], rad[i] = y, _rad(y, E + 2 * U + 2 * U, _underflow((1 + abs(g)) * abs(up[i])), margin)


@jit
def gelu_mul(gate, up, k, a, E, margin, mid, rad):
    for i in range(gate.size):
        g, rel, factor = _gelu(gate[i], k, a, E)
        y = g * up[i]
        mid[i], rad[i] = y, _rad(y, rel + U, _underflow((1 + factor) * abs(up[i])), margin)


@jit
def residual(r, x, h, margin, mid, rad):
    for i in range(x.size):
        product = r * h[i]
        y = x[i] + product
        mid[i], rad[i] = y, _rad(y, U, U * abs(product) * 2 + 2 * TINY, margin)


@jit
def scaled(c, x, margin, mid, rad):
    """c x, one rounding (embed's rows)."""
    for i in range(x.size):
        y = c * x[i]
        mid[i], rad[i] = y, _rad(y, U, 2 * TINY, margin)


@jit
def sigmoid_gate(o, gate, E, margin, mid, rad):
    for i in range(o.size):
        y = o[i] * _sigmoid(gate[i])
        mid[i], rad[i] = y, _rad(y, E + 2 * U + U, 2 * TINY * (1 + abs(o[i])), margin)


@jit
def normalised(x, H, root, rel, kind, w, w_step, z, E, margin, mid, rad):
    """x / root per row of H, times a factor by ``kind``: 0 none, 1 w, 2 (1 + w), 3 w silu(z) (as
    ``spec.enclosures.rmsnorm_gated``); ``rel`` is the root's relative error per row, and w's row
    is w[row * w_step:] (w_step 0: one row for all)."""
    for row in range(root.size):
        r, rn = root[row], rel[row] + U
        for j in range(H):
            i = row * H + j
            n = x[i] / r
            if kind == 0:
                y, relative, absolute = n, rn, 0.0
            elif kind == 1:
                y, relative, absolute = n * w[row * w_step + j], rn + U, 0.0
            elif kind == 2:
                y, relative, absolute = n * (1 + w[row * w_step + j]), rn + 2 * U, 0.0
            else:
                weighted = w[row * w_step + j] * n
                y = weighted * (z[i] * _sigmoid(z[i]))
                relative, absolute = rn + (E + 2 * U) + 3 * U, _underflow(abs(weighted) * (1 + abs(z[i])))
            mid[i], rad[i] = y, _rad(y, relative, absolute, margin)


@jit
def _grown(d):
    """At least e^d - 1, what a shift off by d >= 0 does to exp relatively: d (1 + 2^-19) for d <= 2^-20
    (e^d - 1 <= d (1 + d), and one rounding of a normal product leaves d (1 + 2^-20) below; for a
    subnormal d it falls short by under 2^-2000, inside MARGIN as the bounds' own roundings are; expm1
    costs twice exp), expm1(d) above, with d capped at 700."""
    if d <= 2.0**-20:
        return d * (1 + 2.0**-19)
    return math.expm1(d if not d > 700.0 else 700.0)


@jit
def softmax(s, s_rad, visible, L, E, mid, rel):
    """Weights p and their relative errors per row of L (``spec.enclosures._softmax``): the row's
    largest visible logit (the first, or the first nan; the first logit where none is visible) is
    shifted to 0, and the exp terms are summed in order (their error bound holds in any order).
    ``s_rad`` empty: the logits are exact."""
    exact = s_rad.size == 0
    for row in range(s.size // L):
        start = row * L
        top_index, top, count = start, -math.inf, 0
        for j in range(start, start + L):
            if visible[j]:
                count += 1
                if top == top and (s[j] > top or s[j] != s[j]):
                    top_index, top = j, s[j]
        top_rad = 0.0 if exact else s_rad[top_index]
        if not math.isfinite(top):
            top = 0.0
        total, worst = 0.0, 0.0
        for j in range(start, start + L):
            mid[j], rel[j] = 0.0, 0.0
            if visible[j]:
                z = s[j] - top
                mid[j] = math.exp(z)
                total += mid[j]
                shift = (0.0 if exact else s_rad[j]) + top_rad + U * abs(z)
                rel[j] = _grown(shift) + E
                worst = nan_max(worst, rel[j])
        rel_total = worst + (count - 1) * U
        for j in range(start, start + L):
            if visible[j]:
                mid[j] = mid[j] / (total if total > 0 else 1.0)
                rel[j] = rel[j] + rel_total + U


@jit
def softmax_enclosure(s, visible, L, E, absolute, margin, mid, rad):
    """``softmax`` of exact logits, with radii: rel |p| + ``absolute`` (with the margin) where visible,
    0 elsewhere."""
    softmax(s, np.zeros(0), visible, L, E, mid, rad)
    for j in range(s.size):
        rad[j] = _rad(mid[j], rad[j], absolute, margin) if visible[j] else 0.0


@jit
def rope(x, D, half, positions, freq, rel_freq, E, margin, mid, rad):
    """Rotate-half RoPE (``spec.enclosures.rope``) of N rows of D at ``positions``, one frequency (and
    its relative error) per rotated pair i, i + half (i < freq.size); the rest pass through."""
    for row in range(positions.size):
        base = row * D
        for k in range(D):
            mid[base + k] = x[base + k]
            rad[base + k] = 0.0
        for i in range(freq.size):
            j = i + half
            angle = positions[row] * freq[i]
            error = abs(angle) * (rel_freq[i] + U) + E  # of cos and of sin
            cos, sin = math.cos(angle), math.sin(angle)
            xi = x[base + i]
            xj = x[base + j] if j < D else 0.0
            y = xi * cos - xj * sin
            mid[base + i] = y
            rad[base + i] = (abs(xi) + abs(xj)) * error + 2 * U * (abs(xi * cos) + abs(xj * sin)) + U * abs(y) \
                + 4 * TINY
            if j < D:
                y = xj * cos + xi * sin
                mid[base + j] = y
                rad[base + j] = (abs(xi) + abs(xj)) * error + 2 * U * (abs(xj * cos) + abs(xi * sin)) + U * abs(y) \
                    + 4 * TINY
        for k in range(D):
            mid_k = mid[base + k]
            rad[base + k] = _rad(mid_k, 0.0, rad[base + k], margin)


@jit
def sums_of_squares(x, H, margin, squares, rad):
    """sum_k x_k^2 per row of H, in order, and its bound: x of at most 24 significant bits squares
    exactly in float64 (2 x 24 <= 53 bits; the squares of float32's extremes, 2^-298 and 2^256, lie
    inside float64's normal range), and a recursive sum of n = H - 1 additions of nonnegative terms errs
    by at most gamma_n s, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability, 4.2).  For
    n u <= 1/4, gamma_n s <= 2 n u s-hat (s <= s-hat / (1 - gamma_n)); the margin covers the bound's own
    roundings.  Past that (H > 2^51) there is no bound: inf."""
    for row in range(squares.size):
        total = 0.0
        for k in range(row * H, row * H + H):
            total += x[k] * x[k]
        n = H - 1 if H > 0 else 0
        squares[row] = total
        rad[row] = 2 * n * U * total * margin if n * U <= 0.25 else math.inf


@intrinsic
def _fma(typingctx, x, y, z):
    """x y + z rounded once: LLVM's fma, the CPU's instruction where it has one, else the C library's
    (exact either way, only slower).  The one fused operation here: a bound below states it."""
    def codegen(context, builder, signature, args):
        double = ir.DoubleType()
        fma = builder.module.declare_intrinsic("llvm.fma", [double], ir.FunctionType(double, [double] * 3))
        return builder.call(fma, args)
    return numba.float64(numba.float64, numba.float64, numba.float64), codegen


@jit
def two_sum(x, y):
    """(s, e): s = fl(x + y) and x + y = s + e exactly (Knuth's TwoSum)."""
    s = x + y
    back = s - x
    return s, (x - (s - back)) + (y - back)


@jit
def two_product(x, y):
    """(p, e): p = fl(x y) and x y = p + e exactly (TwoProductFMA)."""
    p = x * y
    return p, _fma(x, y, -p)


# Double-word arithmetic (a value as an unevaluated sum high + low of two float64s): the float64 target's
# enclosures, whose radii must be far below float64's ULP.  Each operation below is a published algorithm
# whose relative error, absent underflow and overflow, is at most 2 u^2 to 10 u^2 (Joldes, Muller and
# Popescu, Tight and rigorous error bounds for basic building blocks of double-word arithmetic, 2017; Muller
# and Rideau 2022 for the product of two; Lefevre, Louvet, Muller, Picot and Rideau 2022 for the square
# root).  The kernels allow DOUBLE_WORD = 2^-100 = 64 u^2 each, and keep every value they bound at least
# DOUBLE_WORD_LOWEST in magnitude (or exactly 0), so that no step underflows.
DOUBLE_WORD = 2.0**-100
DOUBLE_WORD_LOWEST, DOUBLE_WORD_HIGHEST = 2.0**-900, 2.0**1000


@jit
def _fast_two_sum(a, b):
    """(s, e): s = fl(a + b) and a + b = s + e exactly, where |a| >= |b| (Dekker's Fast2Sum)."""
    s = a + b
    return s, b - (s - a)


@jit
def _dw_plus_fp(xh, xl, y):
    """(xh + xl) + y: DWPlusFP, 2 u^2 (Joldes, Muller and Popescu's Algorithm 4)."""
    sh, sl = two_sum(xh, y)
    return _fast_two_sum(sh, xl + sl)


@jit
def _dw_plus_dw(xh, xl, yh, yl):
    """(xh + xl) + (yh + yl): AccurateDWPlusDW, 3 u^2 + 13 u^3 (their Algorithm 6)."""
    sh, sl = two_sum(xh, yh)
    th, tl = two_sum(xl, yl)
    vh, vl = _fast_two_sum(sh, sl + th)
    return _fast_two_sum(vh, tl + vl)


@jit
def _dw_times_fp(xh, xl, y):
    """(xh + xl) y: DWTimesFP3, 2 u^2 (their Algorithm 9)."""
    ch, cl = two_product(xh, y)
    return _fast_two_sum(ch, _fma(xl, y, cl))


@jit
def _dw_times_dw(xh, xl, yh, yl):
    """(xh + xl) (yh + yl): DWTimesDW3, 4 u^2 (their Algorithm 12; the bound is Muller and Rideau's)."""
    ch, cl = two_product(xh, yh)
    return _fast_two_sum(ch, cl + _fma(xl, yh, _fma(xh, yl, xl * yl)))


@jit
def _dw_divide_fp(xh, xl, y):
    """(xh + xl) / y: DWDivFP3, 3 u^2 (their Algorithm 15)."""
    th = xh / y
    ph, pl = two_product(th, y)
    return _fast_two_sum(th, (((xh - ph) - pl) + xl) / y)


@jit
def _dw_divide_dw(xh, xl, yh, yl):
    """(xh + xl) / (yh + yl): DWDivDW2, 15 u^2 + 56 u^3 (their Algorithm 17)."""
    th = xh / yh
    rh, rl = _dw_times_fp(yh, yl, th)
    return _fast_two_sum(th, ((xh - rh) + (xl - rl)) / yh)


@jit
def _dw_sqrt(xh, xl):
    """sqrt(xh + xl) for xh > 0: 25/8 u^2 (Lefevre, Louvet, Muller, Picot and Rideau's SQRTDWtoDW)."""
    sh = math.sqrt(xh)
    return _fast_two_sum(sh, (xl + _fma(-sh, sh, xh)) / (2 * sh))


def _double_word_constants():
    """ln 2 / 256 as C1 + C2 + C3 (C1 of 35 bits, so that n C1 is exact for |n| < 2^18), the table
    2^(j/256), j < 256, and GELU's sqrt(2 / pi) and 0.044715, as double words (high, low): each rounded to
    nearest from 300 bits (mpmath), so within u^2 of the real constant."""
    import mpmath

    def word(value):
        return float(value), float(value - mpmath.mpf(float(value)))

    with mpmath.workprec(300):
        c = mpmath.log(2) / 256
        c1 = float(mpmath.ldexp(mpmath.nint(mpmath.ldexp(c, 43)), -43))  # c < 2^-8: 35 significant bits
        c2 = float(c - c1)
        c3 = float(c - c1 - c2)
        high, low = (np.array(part) for part in zip(*(word(mpmath.power(2, mpmath.mpf(j) / 256)) for j in range(256))))
        gelu = (*word(mpmath.sqrt(2 / mpmath.pi)), *word(mpmath.mpf("0.044715")))
        third = word(mpmath.mpf(1) / 3)
        sixth = word(mpmath.mpf(1) / 6)
        quarter_turn = mpmath.pi / 2  # pi / 2 as Q1 + Q2 + Q3, Q1 of 33 bits (k Q1 exact for k < 2^20)
        q1 = float(mpmath.ldexp(mpmath.nint(mpmath.ldexp(quarter_turn, 32)), -32))
        q2 = float(quarter_turn - q1)
        q3 = float(quarter_turn - q1 - q2)
        step = mpmath.pi / 128  # the table's step, as S1 + S2 + S3, S1 of 45 bits (j S1 exact for j <= 64)
        s1 = float(mpmath.ldexp(mpmath.nint(mpmath.ldexp(step, 50)), -50))
        s2 = float(step - s1)
        s3 = float(step - s1 - s2)
        turns = [word(f(j * step)) for f in (mpmath.sin, mpmath.cos) for j in range(33)]
        sin_high, sin_low = (np.array(part) for part in zip(*turns[:33]))
        cos_high, cos_low = (np.array(part) for part in zip(*turns[33:]))
    return (256 / math.log(2), c1, c2, c3, high, low, *gelu, *third, *sixth, q1, q2, q3, s1, s2, s3, sin_high, sin_low,
            cos_high, cos_low)


(_EXP_SCALE, _LN2_C1, _LN2_C2, _LN2_C3, _EXP_HIGH, _EXP_LOW, _GELU_K_HIGH, _GELU_K_LOW, _GELU_A_HIGH, _GELU_A_LOW,
 _THIRD_HIGH, _THIRD_LOW, _SIXTH_HIGH, _SIXTH_LOW, _QUARTER_1, _QUARTER_2, _QUARTER_3, _STEP_1, _STEP_2, _STEP_3,
 _SIN_HIGH, _SIN_LOW, _COS_HIGH, _COS_LOW) = _double_word_constants()
# e^y's relative error bound (``_exp_double_word``) and the range of y it holds on.
EXP_DOUBLE_WORD = 2.0**-76
EXP_LOWEST, EXP_HIGHEST = -707.0, 709.0


@intrinsic
def from_bits(typingctx, n):
    """The float64 with bits ``n`` (a bit cast, no arithmetic)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return numba.float64(numba.int64), codegen


@jit
def _power_of_two(k):
    """2^k for -1022 <= k <= 1023, from its exponent field (the C library's ldexp, a call, cost the double-word
    exp a third of its time)."""
    return from_bits((k + 1023) << 52)


@jit
def _exp_double_word(y, y_low):
    """e^(y + y_low) for EXP_LOWEST <= y <= EXP_HIGHEST, |y_low| <= 2^-43, as a double word, within EXP_DOUBLE_WORD
    of it relatively and 2^-1074 absolutely (its low part may be subnormal).  y = n ln 2 / 256 + r, n = rint(256 y /
    ln 2) (|n| < 2^18, |r| <= 2^-9.4).  n C1 is exact, and so is y - n C1 (both are multiples of y's ULP, or of
    2^-43, a multiple of it, and the difference is below 2^-9.4); r = (y - n C1) - n C2 - n C3 + y_low as a double
    word (n C2 split by TwoProductFMA) is off by under 2^-94 (roundings of terms below 2^-42, and n times ln 2 / 256
    - C1 - C2 - C3 < 2^-150).  e^r = 1 + r + r^2 / 2 + r^3 P(r), P the Taylor polynomial to r^4 / 5040, which leaves
    out under 2^-90 of e^r; r^3 P(r), below 2^-30.8, is computed in float64 from r's high part (its 12 roundings,
    its coefficients' included, and r's low part leave under 2^-79.5 of e^r), the rest as double words (DOUBLE_WORD
    each).  Times 2^(j/256), j = n mod 256 (a double word within u^2 of it; DOUBLE_WORD), and 2^k, k = (n - j) / 256
    (exact while the high part is normal: y >= -707).  These sum to under 2^-79: EXP_DOUBLE_WORD is eight times
    that."""
    n = float(math.floor(y * _EXP_SCALE + 0.5))
    j = int(n) & 255
    k = (int(n) - j) >> 8
    p2h, p2l = two_product(n, _LN2_C2)
    sh, e = two_sum(y - n * _LN2_C1, -p2h)
    rh, rl = _fast_two_sum(sh, ((e - p2l) - n * _LN2_C3) + y_low)
    tail = rh * rh * rh * (1 / 6 + rh * (1 / 24 + rh * (1 / 120 + rh * (1 / 720 + rh / 5040))))
    qh, ql = _dw_times_dw(rh, rl, rh, rl)
    mh, ml = _dw_plus_dw(rh, rl, 0.5 * qh, 0.5 * ql)
    mh, ml = _dw_plus_fp(mh, ml, tail)
    eh, el = _dw_plus_fp(mh, ml, 1.0)
    zh, zl = _dw_times_dw(_EXP_HIGH[j], _EXP_LOW[j], eh, el)
    scale = _power_of_two(k)
    return zh * scale, zl * scale


@jit
def _exp_below(y):
    """Above e^(y + a) / (1 - 2^-20) for y <= -620 and |a| <= 2^-19 + 2^-53 |y|: 2^k, k = floor(c) + 2, c = y
    log2(e) (1 - 2^-50) (two roundings move y log2(e) by at most 2^-51.9 of itself; the factor moves it
    toward 0 by more, so c >= (y + 2^-53 |y|) log2(e), and e^(2^-19) / (1 - 2^-20) < 2), or 2^-1074 where that
    is less (no float64 lies between it and 0; below -1100, so that k stays an integer)."""
    if y < -1100.0:
        return 2.0**-1074
    k = math.floor(y * 1.4426950408889634 * (1 - 2.0**-50)) + 2
    return math.ldexp(1.0, k) if k >= -1074 else 2.0**-1074


@jit
def _sigmoid_double_word(x, x_low, x_error):
    """1 / (1 + e^-x) for x = x + x_low (a double word, |x_low| <= 2^-43) known within x_error, as (high,
    low, relative error, absolute error): e^-x (``_exp_double_word``, moved by at most e^x_error - 1 <=
    x_error (1 + x_error) relatively for x_error <= 2^-20), 1 + it (DWPlusFP: its error passes on at most
    once, the sum being >= 1) and the reciprocal (DWDivDW), each adding DOUBLE_WORD.  Past -x > 620 the
    result lies in (0, e^x): 0 within ``_exp_below`` (x_error up to 2^-53 |x| there); below -x < EXP_LOWEST,
    in (1 - 2^-1019, 1): 1 within 2^-1019.  nan, or x_error past those: inf."""
    y = -x
    if y != y:
        return y, 0.0, math.inf, 0.0
    if y > 620.0:
        if not x_error <= 2.0**-20 + 2.0**-53 * y:
            return y, 0.0, math.inf, 0.0
        return 0.0, 0.0, 0.0, _exp_below(x)
    if y < EXP_LOWEST:
        return 1.0, 0.0, 0.0, 2.0**-1019
    if not x_error <= 2.0**-20:
        return y, 0.0, math.inf, 0.0
    eh, el = _exp_double_word(y, -x_low)
    dh, dl = _dw_plus_fp(eh, el, 1.0)
    error = (EXP_DOUBLE_WORD + x_error * (1 + x_error)) * eh + 2.0**-1074 + DOUBLE_WORD * dh
    sh, sl = _dw_divide_dw(1.0, 0.0, dh, dl)
    return sh, sl, error / dh + DOUBLE_WORD, 0.0


@jit
def _in_range(high):
    """Whether a double word's magnitude lies in [DOUBLE_WORD_LOWEST, DOUBLE_WORD_HIGHEST], where its bounds hold."""
    return DOUBLE_WORD_LOWEST <= abs(high) <= DOUBLE_WORD_HIGHEST


@jit
def _above(a, b):
    """At least the product of a, b >= 0, where it may be subnormal: fl(a b) (1 + 2^-50) + 2^-1073 (each of its three
    roundings loses at most u relative or 2^-1075; 2^-50 > 3 u); 0 where a or b is."""
    if a == 0 or b == 0:
        return 0.0
    return (a * b) * (1 + 2.0**-50) + 2.0**-1073


@jit
def _double_word_rad(high, relative, absolute, exact_zero, margin):
    """A double-word result's radius: 0 where it is exactly 0 (``exact_zero``: a factor is 0), relative
    |high| + absolute with the margin where high lies in [DOUBLE_WORD_LOWEST, DOUBLE_WORD_HIGHEST] or is 0
    with an absolute part (a product with the 0 of ``_sigmoid_double_word``'s extreme: exact), inf
    elsewhere."""
    if exact_zero:
        return 0.0
    magnitude = abs(high)
    if DOUBLE_WORD_LOWEST <= magnitude <= DOUBLE_WORD_HIGHEST or (magnitude == 0 and absolute > 0):
        return (relative * magnitude + absolute) * margin
    return math.inf


@jit
def sigmoid_double_word(x, margin, high, low, rad):
    for i in range(x.size):
        sh, sl, relative, absolute = _sigmoid_double_word(x[i], 0.0, 0.0)
        high[i], low[i], rad[i] = sh, sl, _double_word_rad(sh, relative, absolute, False, margin)


@jit
def silu_double_word(x, margin, high, low, rad):
    """x sigmoid(x): one more product (DWTimesFP)."""
    for i in range(x.size):
        sh, sl, relative, absolute = _sigmoid_double_word(x[i], 0.0, 0.0)
        yh, yl = _dw_times_fp(sh, sl, x[i])
        high[i], low[i] = yh, yl
        rad[i] = _double_word_rad(yh, relative + DOUBLE_WORD, _above(absolute, abs(x[i])), x[i] == 0, margin)


@jit
def silu_mul_double_word(gate, up, margin, high, low, rad):
    """silu(gate) up: two more products (inf where the first is outside the double words' range)."""
    for i in range(gate.size):
        g = gate[i]
        sh, sl, relative, absolute = _sigmoid_double_word(g, 0.0, 0.0)
        inner, yl = _dw_times_fp(sh, sl, g)
        yh, yl = _dw_times_fp(inner, yl, up[i])
        high[i], low[i] = yh, yl
        zero = (g == 0 or up[i] == 0) and math.isfinite(g) and math.isfinite(up[i])
        rad[i] = _double_word_rad(yh, relative + 2 * DOUBLE_WORD, _above(_above(absolute, abs(g)), abs(up[i])), zero,
                                  margin) if zero or _in_range(inner) else math.inf


@jit
def sigmoid_gate_double_word(o, gate, margin, high, low, rad):
    """o sigmoid(gate): one more product."""
    for i in range(o.size):
        sh, sl, relative, absolute = _sigmoid_double_word(gate[i], 0.0, 0.0)
        yh, yl = _dw_times_fp(sh, sl, o[i])
        high[i], low[i] = yh, yl
        zero = o[i] == 0 and math.isfinite(gate[i])
        rad[i] = _double_word_rad(yh, relative + DOUBLE_WORD, _above(absolute, abs(o[i])), zero, margin)


@jit
def root_double_word(x, H, mean, eps, high, low, rel):
    """sqrt(sum_k x_k^2 / H + eps) per row of H (without / H where ``mean`` is false) as a double word,
    and its relative error (``spec.enclosures.rms`` and the norms).  The sum of squares is Ogita, Rump and
    Oishi's Dot2 on the float64 x (each square split exactly by TwoProductFMA, summed by TwoSum): it errs
    by at most gamma_2H^2 of the sum (their Theorem 5.3 over its 2 H terms), taken twice for the computed
    sum's own error, plus 2^-1073 for each x below 2^-510, whose square or its error may underflow.  A sum
    below 2^-800 counts as 0 within twice itself (its quotient could underflow).  The quotient, the sum
    with eps (terms >= 0: their relative errors pass on at most once) and the square root (which halves
    what it is given) each add DOUBLE_WORD.  rel is inf where H u > 2^-22 or where the root's argument is
    outside [DOUBLE_WORD_LOWEST, DOUBLE_WORD_HIGHEST] (the sum overflowed, or eps is 0 and the sum tiny)."""
    n = 2 * H
    gamma = n * U / (1 - n * U)
    for row in range(high.size):
        sh, sl, tiny = 0.0, 0.0, 0
        for k in range(row * H, row * H + H):
            product, error = two_product(x[k], x[k])
            sh, rounding = two_sum(sh, product)
            sl = sl + (rounding + error)
            if x[k] != 0 and abs(x[k]) < 2.0**-510:
                tiny += 1
        sh, sl = _fast_two_sum(sh, sl)
        error = 2 * gamma * gamma * sh + tiny * 2.0**-1073
        if sh < 2.0**-800:
            mh, ml, error = 0.0, 0.0, 2 * (sh + error)
        elif mean:
            mh, ml = _dw_divide_fp(sh, sl, H)
            error = error / H + DOUBLE_WORD * mh
        else:
            mh, ml = sh, sl
        th, tl = _dw_plus_fp(mh, ml, eps)
        error = error + DOUBLE_WORD * th
        if not (DOUBLE_WORD_LOWEST <= th <= DOUBLE_WORD_HIGHEST) or n * U > 2.0**-21:
            high[row], low[row], rel[row] = th, tl, math.inf
        else:
            high[row], low[row] = _dw_sqrt(th, tl)
            rel[row] = error / th / 2 + DOUBLE_WORD


@jit
def normalised_double_word(x, H, root_high, root_low, root_rel, kind, w, w_step, z, margin, high, low, rad):
    """x / root per row of H (``root_double_word``) as a double word, times a factor by ``kind``: 0 none, 1 w, 2 (1
    + w) (exact by TwoSum), 3 w silu(z) (``_sigmoid_double_word``, three more products); w's row is w[row *
    w_step:].  The root's reciprocal (DWDivDW) and each product add DOUBLE_WORD.  A result is exactly 0 where x or a
    factor is 0 and the rest finite; otherwise rad is inf where x / root (for 3 also w x / root, and
    z sigmoid(z) unless 0) is outside [DOUBLE_WORD_LOWEST, DOUBLE_WORD_HIGHEST], and as ``_double_word_rad`` says."""
    for row in range(root_high.size):
        rh, rl = _dw_divide_dw(1.0, 0.0, root_high[row], root_low[row])
        for j in range(H):
            i = row * H + j
            nh, nl = _dw_times_fp(rh, rl, x[i])
            relative, absolute, inner = root_rel[row] + 2 * DOUBLE_WORD, 0.0, True
            zero = x[i] == 0
            if kind == 1:
                factor = w[row * w_step + j]
                yh, yl = _dw_times_fp(nh, nl, factor)
                relative += DOUBLE_WORD
                zero = zero or factor == 0
            elif kind == 2:
                factor, factor_low = two_sum(1.0, w[row * w_step + j])
                yh, yl = _dw_times_dw(nh, nl, factor, factor_low)
                relative += DOUBLE_WORD
                zero = zero or factor == 0
            elif kind == 3:
                factor = w[row * w_step + j]
                wh, wl = _dw_times_fp(nh, nl, factor)
                sh, sl, relative_s, absolute_s = _sigmoid_double_word(z[i], 0.0, 0.0)
                sh, sl = _dw_times_fp(sh, sl, z[i])
                inner = _in_range(wh) and (sh == 0 or _in_range(sh))
                yh, yl = _dw_times_dw(wh, wl, sh, sl)
                relative += relative_s + 3 * DOUBLE_WORD
                absolute = _above(_above(absolute_s, abs(z[i])), abs(wh) * (1 + 2.0**-40))
                zero = zero or factor == 0 or z[i] == 0
            else:
                yh, yl = nh, nl
            zero = zero and math.isfinite(x[i]) and (kind == 0 or math.isfinite(w[row * w_step + j])) and \
                (kind != 3 or math.isfinite(z[i]))
            if zero:  # the exact result is 0 whatever the root (which may have overflowed)
                yh, yl = 0.0, 0.0
            high[i], low[i] = yh, yl
            if not zero and not (_in_range(nh) and inner):
                rad[i] = math.inf
            else:
                rad[i] = _double_word_rad(yh, relative, absolute, zero, margin)


@jit
def _gelu_double_word(x):
    """x / (1 + exp(-s)), s = 2 k (x + a x^3) (``spec.enclosures.gelu_tanh``'s, k = sqrt(2 / pi) and a = 0.044715
    double words within u^2), as ``_sigmoid_double_word``'s four numbers for x sigmoid(s): x^2 exact
    (TwoProductFMA), x^3 (DWTimesFP), a x^3 (DWTimesDW), x + it (DWPlusFP; terms of one sign), times k
    (DWTimesDW) and 2 (exact): s within (4 DOUBLE_WORD + 2 u^2) |s|; the product with x adds DOUBLE_WORD.
    |x| < 2^-290 but 0 (its cube would underflow): inf; past 2^300 (its cube may overflow), s has x's sign
    and is past sigmoid's extremes, which x itself gives."""
    if x != 0 and abs(x) < 2.0**-290:
        return x, 0.0, math.inf, 0.0
    if abs(x) > 2.0**300:
        gh, gl, relative, absolute = _sigmoid_double_word(x, 0.0, 0.0)
    else:
        qh, ql = two_product(x, x)
        ch, cl = _dw_times_fp(qh, ql, x)
        ch, cl = _dw_times_dw(ch, cl, _GELU_A_HIGH, _GELU_A_LOW)
        sh, sl = _dw_plus_fp(ch, cl, x)
        sh, sl = _dw_times_dw(sh, sl, _GELU_K_HIGH, _GELU_K_LOW)
        sh, sl = 2 * sh, 2 * sl
        gh, gl, relative, absolute = _sigmoid_double_word(sh, sl, (4 * DOUBLE_WORD + 2 * U * U) * abs(sh) *
                                                          (1 + 2.0**-50))
    yh, yl = _dw_times_fp(gh, gl, x)
    return yh, yl, relative + DOUBLE_WORD, _above(absolute, abs(x))


@jit
def gelu_tanh_double_word(x, margin, high, low, rad):
    for i in range(x.size):
        yh, yl, relative, absolute = _gelu_double_word(x[i])
        high[i], low[i] = yh, yl
        rad[i] = _double_word_rad(yh, relative, absolute, x[i] == 0, margin)


@jit
def gelu_mul_double_word(gate, up, margin, high, low, rad):
    """gelu_tanh(gate) up: one more product."""
    for i in range(gate.size):
        g = gate[i]
        yh, yl, relative, absolute = _gelu_double_word(g)
        yh, yl = _dw_times_fp(yh, yl, up[i])
        high[i], low[i] = yh, yl
        zero = (g == 0 or up[i] == 0) and math.isfinite(g) and math.isfinite(up[i])
        rad[i] = _double_word_rad(yh, relative + DOUBLE_WORD, _above(absolute, abs(up[i])), zero, margin)


# tanh's relative error bound (``_tanh_double_word``).
TANH_DOUBLE_WORD = 2.0**-70


@jit
def _tanh_double_word(qh, ql, q_error):
    """tanh(q) for q = qh + ql (a double word) known within q_error <= 2^-30 |q|, as (high, low, relative
    error), |q| = a:
    - a < 2^-300: a itself, within a^2 / 3 < 2^-600 of the result;
    - a < 2^-5: a (1 - a^2 / 3 + a^4 R(a^2)), R the Taylor series' next five terms: what it leaves out
      is below its first term left out, 2^-79.4 of the result (alternating and falling); a^4 R, below
      2^-22.9, in float64 from qh (its 14 roundings and ql's omission leave under 2^-71.5), the rest as
      double words (1/3 within u^2; DOUBLE_WORD each);
    - 2^-5 <= a <= 353: (1 - E) / (1 + E), E = e^-2a (``_exp_double_word``; within EXP_DOUBLE_WORD plus
      2^-1074), whose error 1 - E >= 1/17 passes on at most 17 times, 1 + E once, and the quotient
      (DWDivDW) and the differences add DOUBLE_WORD each;
    - past 353: 1 within 2^-1017 (e^-706 < 2^-1018, and 1 - tanh(a) < 2 e^-2a).
    The error of q, a shift of at most q_error, moves tanh by at most q_error / a of itself (tanh(a) / a
    falls, so its condition is at most 1).  Each case's sum is under TANH_DOUBLE_WORD = 2^-70 plus
    q_error / a; the last case's absolute part is returned as its relative error (the result is 1)."""
    a, al = (qh, ql) if qh >= 0 else (-qh, -ql)
    sign = 1.0 if qh >= 0 else -1.0
    shift = q_error / a
    if a < 2.0**-300:
        return qh, ql, TANH_DOUBLE_WORD + shift
    if a < 2.0**-5:
        square = a * a
        tail = square * square * (2 / 15 + square * (-17 / 315 + square * (62 / 2835 + square * (
            -1382 / 155925 + square * (21844 / 6081075)))))
        sh, sl = _dw_times_dw(a, al, a, al)
        sh, sl = _dw_times_dw(sh, sl, -_THIRD_HIGH, -_THIRD_LOW)
        th, tl = _dw_plus_fp(sh, sl, 1.0)
        th, tl = _dw_plus_fp(th, tl, tail)
        th, tl = _dw_times_dw(th, tl, a, al)
        return sign * th, sign * tl, TANH_DOUBLE_WORD + shift
    if a > 353.0:
        return sign, 0.0, 2.0**-1017 + shift
    eh, el = _exp_double_word(-2 * a, -2 * al)
    exp_error = EXP_DOUBLE_WORD * eh + 2.0**-1074
    nh, nl = _dw_plus_fp(-eh, -el, 1.0)
    dh, dl = _dw_plus_fp(eh, el, 1.0)
    th, tl = _dw_divide_dw(nh, nl, dh, dl)
    return sign * th, sign * tl, exp_error / nh + exp_error / dh + 3 * DOUBLE_WORD + shift


@jit
def softcap_double_word(c, x, margin, high, low, rad):
    """c tanh(x / c): x / c by DWDivFP (DOUBLE_WORD), ``_tanh_double_word`` and the product (DWTimesFP,
    DOUBLE_WORD).  x = 0: exactly 0; x / c outside [DOUBLE_WORD_LOWEST, DOUBLE_WORD_HIGHEST]: inf."""
    for i in range(x.size):
        qh, ql = _dw_divide_fp(x[i], 0.0, c)
        if x[i] == 0:
            high[i], low[i], rad[i] = 0.0, 0.0, 0.0
            continue
        if not DOUBLE_WORD_LOWEST <= abs(qh) <= DOUBLE_WORD_HIGHEST:
            high[i], low[i], rad[i] = qh, 0.0, math.inf
            continue
        th, tl, relative = _tanh_double_word(qh, ql, DOUBLE_WORD * abs(qh) * (1 + 2.0**-50))
        yh, yl = _dw_times_fp(th, tl, c)
        high[i], low[i] = yh, yl
        rad[i] = _double_word_rad(yh, relative + DOUBLE_WORD, 0.0, False, margin)


@jit
def softmax_double_word(s, s_low, s_rad, visible, L, margin, high, low, rad):
    """Weights per row of L (``spec.enclosures.softmax`` for float64, and attention's) as double words, of
    logits s + s_low (a double word; ``s_low`` empty: 0) each within s_rad of the exact one (empty: exact).
    top, the row's largest visible logit, is shifted to 0 (any shift t gives the same weights, as long as
    every term has it: its own error does not count).  z = s - top is exact as TwoSum's pair, or within
    DOUBLE_WORD |z| as AccurateDWPlusDW's; e^z (``_exp_double_word``, within EXP_DOUBLE_WORD plus 2^-1074)
    is then within EXP_DOUBLE_WORD + e^d - 1 (``_grown``) of the exact term e^(s - t), d = s_rad + DOUBLE_WORD
    |z|, for d <= 2^-20; below EXP_LOWEST it is 0 within ``_exp_below``.  Their sum in order by AccurateDWPlusDW
    (terms >= 0: n additions err by at most n DOUBLE_WORD of the sum, which also carries its terms' largest
    relative error and their absolute parts); p = e^z / sum (DWDivDW, DOUBLE_WORD).  The sum is at least 1
    (top's term is exactly 1), so the absolute parts move p by at most their total, relatively.  p below
    DOUBLE_WORD_LOWEST (its quotient may underflow): within 2^-899, above it.  A row with a visible logit
    that is not finite, or d past 2^-20: inf; with none visible: 0, exactly."""
    lows, radii = s_low.size > 0, s_rad.size > 0
    for row in range(s.size // L):
        start = row * L
        top, top_low, count, finite = -math.inf, 0.0, 0, True
        for j in range(start, start + L):
            if visible[j]:
                count += 1
                finite = finite and math.isfinite(s[j]) and (not radii or s_rad[j] <= 2.0**-20)
                if s[j] > top:
                    top, top_low = s[j], s_low[j] if lows else 0.0
        th, tl, absolute, worst = 0.0, 0.0, 0.0, 0.0
        for j in range(start, start + L):
            high[j], low[j], rad[j] = 0.0, 0.0, 0.0
            if visible[j] and finite:
                if lows:
                    zh, zl = _dw_plus_dw(s[j], s_low[j], -top, -top_low)
                    d = (s_rad[j] if radii else 0.0) + DOUBLE_WORD * abs(zh)
                else:
                    zh, zl = two_sum(s[j], -top)
                    d = s_rad[j] if radii else 0.0
                if d > 2.0**-20:
                    finite = False
                elif zh < EXP_LOWEST:
                    rad[j] = _exp_below(zh)
                    absolute += rad[j]
                else:
                    high[j], low[j] = _exp_double_word(zh, zl)
                    absolute += 2.0**-1074
                    rad[j] = _grown(d)  # the term's own part of its relative error, for now
                    worst = max(worst, rad[j])
                    th, tl = _dw_plus_dw(th, tl, high[j], low[j])
        shared = 0.0
        if count and finite:
            shared = EXP_DOUBLE_WORD + worst + count * DOUBLE_WORD + absolute / th + DOUBLE_WORD
        for j in range(start, start + L):
            if not visible[j]:
                continue
            if not finite:
                high[j], low[j], rad[j] = math.nan, 0.0, math.inf
            elif high[j] != 0:
                ph, pl = _dw_divide_dw(high[j], low[j], th, tl)
                high[j], low[j] = ph, pl
                relative = EXP_DOUBLE_WORD + rad[j] + shared
                rad[j] = (relative * ph + 2.0**-1074) * margin if ph >= DOUBLE_WORD_LOWEST else 2.0**-899
            else:
                rad[j] = rad[j] * margin


# The absolute error bound of ``_cos_sin_double_word`` and the angles it takes.
COS_SIN_DOUBLE_WORD, COS_SIN_HIGHEST = 2.0**-76, 2.0**20


@jit
def _reduced(a, a_low, k, p1, p2, p3):
    """a + a_low - k (p1 + p2 + p3) as a double word: k p1 and a - k p1 exact (the caller's ranges), k p2
    split by TwoProductFMA, the rest summed with three roundings of terms below 2^-33."""
    p2h, p2l = two_product(k, p2)
    sh, e = two_sum(a - k * p1, -p2h)
    return _fast_two_sum(sh, ((e - p2l) - k * p3) + a_low)


@jit
def _cos_sin_double_word(a, a_low):
    """(cos, sin) of a + a_low, |a| < COS_SIN_HIGHEST, as double words within COS_SIN_DOUBLE_WORD each,
    absolutely.  a = k pi / 2 + r, k = rint(2 a / pi) < 2^20: k Q1 is exact and so is a - k Q1 (both are
    multiples of a's ULP or of 2^-32, a multiple of it, and the difference is below 0.8); r off by under
    2^-86 (roundings of terms below 2^-35, and k times pi / 2 - Q1 - Q2 - Q3 < 2^-150).  r = j pi / 128 + b,
    |j| <= 32, |b| <= pi / 256 + 2^-40 (b the same way, off by under 2^-100), and cos and sin of j pi / 128
    from a table of double words (within u^2).  sin b = b - b^3 / 6 + b^5 T(b^2) and cos b = 1 - b^2 / 2 +
    b^4 V(b^2), Taylor to b^9 and b^8: they leave out under 2^-94 and 2^-85; b^5 T (below 2^-38.7) and b^4
    V (below 2^-30) in float64 from b's high part (under 2^-84 and 2^-79 with b's low part), the rest as
    double words (1/6 within u^2; DOUBLE_WORD each, of terms at most 1).  The angle-sum formulas add two
    products and a sum of double words (DOUBLE_WORD each, of terms at most 1).  These sum to under
    2^-78.5; COS_SIN_DOUBLE_WORD is four times that.  The quadrant k mod 4 swaps and negates, exactly."""
    k = float(math.floor(a * (2 / math.pi) + 0.5))
    rh, rl = _reduced(a, a_low, k, _QUARTER_1, _QUARTER_2, _QUARTER_3)
    j = float(math.floor(rh * (128 / math.pi) + 0.5))
    bh, bl = _reduced(rh, rl, j, _STEP_1, _STEP_2, _STEP_3)
    square = bh * bh
    sh, sl = _dw_times_dw(bh, bl, bh, bl)
    ch, cl = _dw_plus_fp(-0.5 * sh, -0.5 * sl, 1.0)
    ch, cl = _dw_plus_fp(ch, cl, square * square * (1 / 24 + square * (-1 / 720 + square * (1 / 40320))))
    th, tl = _dw_times_dw(sh, sl, bh, bl)
    th, tl = _dw_times_dw(th, tl, -_SIXTH_HIGH, -_SIXTH_LOW)
    th, tl = _dw_plus_dw(th, tl, bh, bl)
    sin_h, sin_l = _dw_plus_fp(th, tl, bh * square * square * (1 / 120 + square * (-1 / 5040 + square * (1 / 362880))))
    index = int(abs(j))
    sign = 1.0 if j >= 0 else -1.0
    table_ch, table_cl = _COS_HIGH[index], _COS_LOW[index]
    table_sh, table_sl = sign * _SIN_HIGH[index], sign * _SIN_LOW[index]
    # cos(t + b) = cos t cos b - sin t sin b, sin(t + b) = sin t cos b + cos t sin b
    xh, xl = _dw_times_dw(table_ch, table_cl, ch, cl)
    yh, yl = _dw_times_dw(table_sh, table_sl, sin_h, sin_l)
    cos_h, cos_l = _dw_plus_dw(xh, xl, -yh, -yl)
    xh, xl = _dw_times_dw(table_sh, table_sl, ch, cl)
    yh, yl = _dw_times_dw(table_ch, table_cl, sin_h, sin_l)
    sin_h, sin_l = _dw_plus_dw(xh, xl, yh, yl)
    quadrant = int(k) & 3
    if quadrant == 0:
        return cos_h, cos_l, sin_h, sin_l
    if quadrant == 1:
        return -sin_h, -sin_l, cos_h, cos_l
    if quadrant == 2:
        return -cos_h, -cos_l, -sin_h, -sin_l
    return sin_h, sin_l, -cos_h, -cos_l


@jit
def rope_double_word(x, D, half, positions, freq_high, freq_low, margin, high, low, rad):
    """Rotate-half RoPE (``spec.enclosures.rope``) of N rows of D at ``positions`` as double words, one
    inverse frequency per rotated pair i, i + half (a double word within u^2 of theta^(-2i / denom)).  The
    angle pos w (DWTimesFP: DOUBLE_WORD, and the frequency's u^2) moves cos and sin by at most 2^-99 |a|
    (their slopes are at most 1), and ``_cos_sin_double_word`` errs by COS_SIN_DOUBLE_WORD: e, absolutely.
    x_i cos - x_j sin (and x_j cos + x_i sin): two products (DWTimesFP) and their sum (AccurateDWPlusDW)
    err by at most DOUBLE_WORD of the products' magnitudes and of the result, and e of |x_i| + |x_j|; 2^-1021
    covers what products below 2^-969 lose.  An angle past COS_SIN_HIGHEST: inf."""
    for row in range(positions.size):
        base = row * D
        for m in range(D):
            high[base + m], low[base + m], rad[base + m] = x[base + m], 0.0, 0.0
        for i in range(freq_high.size):
            j = i + half
            ah, al = _dw_times_fp(freq_high[i], freq_low[i], positions[row])
            xi = x[base + i]
            xj = x[base + j] if j < D else 0.0
            if not abs(ah) < COS_SIN_HIGHEST:
                rad[base + i] = math.inf
                if j < D:
                    rad[base + j] = math.inf
                continue
            ch, cl, sh, sl = _cos_sin_double_word(ah, al)
            error = (COS_SIN_DOUBLE_WORD + 2.0**-99 * abs(ah)) * (abs(xi) + abs(xj))
            ph, pl = _dw_times_fp(ch, cl, xi)
            qh, ql = _dw_times_fp(sh, sl, xj)
            yh, yl = _dw_plus_dw(ph, pl, -qh, -ql)
            high[base + i], low[base + i] = yh, yl
            rad[base + i] = (error + DOUBLE_WORD * (2 * abs(ph) + 2 * abs(qh) + abs(yh)) + 2.0**-1021) * margin
            if j < D:
                ph, pl = _dw_times_fp(ch, cl, xj)
                qh, ql = _dw_times_fp(sh, sl, xi)
                yh, yl = _dw_plus_dw(ph, pl, qh, ql)
                high[base + j], low[base + j] = yh, yl
                rad[base + j] = (error + DOUBLE_WORD * (2 * abs(ph) + 2 * abs(qh) + abs(yh)) + 2.0**-1021) * margin


@jit
def _product_underflow(p, a, b):
    """What TwoProductFMA's p + e may miss of a b: 2^-1074 where the product is below 2^-969 (p or e
    may then be subnormal), else 0."""
    return 2.0**-1074 if abs(p) < 2.0**-969 and a != 0 and b != 0 else 0.0


@jit
def residual_double_word(r, x, h, margin, high, low, rad):
    """x + r h as a double word: r h split exactly by TwoProductFMA, plus x by DWPlusFP (DOUBLE_WORD of
    the result, cancellation or not: additions never underflow); inf past DOUBLE_WORD_HIGHEST."""
    for i in range(x.size):
        product, error = two_product(r, h[i])
        yh, yl = _dw_plus_fp(product, error, x[i])
        high[i], low[i] = yh, yl
        if abs(yh) <= DOUBLE_WORD_HIGHEST and abs(product) <= DOUBLE_WORD_HIGHEST:
            rad[i] = (DOUBLE_WORD * abs(yh) + _product_underflow(product, r, h[i])) * margin
        else:
            rad[i] = math.inf


@jit
def scaled_double_word(c, x, high, low, rad):
    """c x as a double word, exactly (TwoProductFMA) but for ``_product_underflow``; inf past
    DOUBLE_WORD_HIGHEST."""
    for i in range(x.size):
        yh, yl = two_product(c, x[i])
        high[i], low[i] = yh, yl
        rad[i] = _product_underflow(yh, c, x[i]) if abs(yh) <= DOUBLE_WORD_HIGHEST else math.inf


@jit
def scaled_sums_double_word(c, x_high, x_low, x_rad, high, low, rad):
    """c (x_high + x_low) for double words each within x_rad of an exact value, as a double word within |c|
    x_rad + DOUBLE_WORD of it (DWTimesFP) + 2^-1072 where the product is below 2^-969 (its parts may then be
    subnormal) of c times that value; inf past DOUBLE_WORD_HIGHEST."""
    for i in range(x_high.size):
        yh, yl = _dw_times_fp(x_high[i], x_low[i], c)
        high[i], low[i] = yh, yl
        if abs(yh) <= DOUBLE_WORD_HIGHEST:
            tiny = 2.0**-1072 if abs(yh) < 2.0**-969 else 0.0
            rad[i] = (abs(c) * x_rad[i] + DOUBLE_WORD * abs(yh) + tiny) * (1 + 2.0**-50)
        else:
            rad[i] = math.inf


@jit
def weighted_sums(p_high, p_low, v, high, low):
    """sum_l (p_high + p_low)[r, l] v[l, d] for p [R, L] as two float64s and v [L, D], into the double-double
    high + low [R, D]: each p_high v exactly (TwoProductFMA, as ``dot_sums``), summed into high by TwoSum,
    whose errors, the products' and p_low v go to low, normalised at the end by TwoSum (exact).  That is
    Ogita, Rump and Oishi's Dot2 (Accurate sum and dot product, 2005) and one more term a product: high +
    low errs by at most gamma_L^2 sum_l |p_l v_l| and L 2^-104 of it for p_low, under 2^-66 of it for L <=
    2^20.  Subnormal products and their errors add at most 2^-1071 (L + sum_l |v_l|) in all.  |v| <= 2^995
    and p in [0, 1] keep every step finite."""
    R, L = p_high.shape
    D = v.shape[1]
    for r in range(R):
        for d in range(D):
            high[r, d], low[r, d] = 0.0, 0.0
        for l in range(L):
            a, b = p_high[r, l], p_low[r, l]
            for d in range(D):
                x = v[l, d]
                product, error = two_product(a, x)
                high[r, d], rounding = two_sum(high[r, d], product)
                low[r, d] = low[r, d] + (rounding + error + b * x)
        for d in range(D):
            high[r, d], low[r, d] = two_sum(high[r, d], low[r, d])


DOT_LANES = 16  # the partial sums of one dot product, kept side by side: they fill the CPU's vector lanes


@jit
def dot_sums(a, b, high, low, magnitude, b_sums):
    """sum_k a[r, k] b[n, k] for float64 a [R, K] and b [N, K] as the double-double high + low [R, N],
    sum_k |fl(a b)| into magnitude and sum_k |b[n, k]| into b_sums: Ogita, Rump and Oishi's Dot2
    (Accurate sum and dot product, 2005) with the products' errors from an FMA (their TwoProductFMA:
    fl(a b) + fma(a, b, -fl(a b)) = a b exactly), the sums' from TwoSum, both exact; the errors are
    summed into low.  The K terms go to DOT_LANES
    partial sums, k mod DOT_LANES, which are then summed in order, the same way, and then the last K mod
    DOT_LANES terms; high + low is normalised at the end by TwoSum (exact: |low| <= ULP(high) / 2).
    ``spec.exact.double_double_radius`` bounds the result."""
    R, K = a.shape
    N = b.shape[0]
    lanes_high, lanes_low, lanes_magnitude = np.empty(DOT_LANES), np.empty(DOT_LANES), np.empty(DOT_LANES)
    full = K - K % DOT_LANES
    for n in range(N):
        for j in range(DOT_LANES):
            lanes_magnitude[j] = 0.0
        for start in range(0, full, DOT_LANES):
            for j in range(DOT_LANES):
                lanes_magnitude[j] = lanes_magnitude[j] + abs(b[n, start + j])
        total = 0.0
        for j in range(DOT_LANES):
            total = total + lanes_magnitude[j]
        for k in range(full, K):
            total = total + abs(b[n, k])
        b_sums[n] = total
        for r in range(R):
            for j in range(DOT_LANES):
                lanes_high[j], lanes_low[j], lanes_magnitude[j] = 0.0, 0.0, 0.0
            for start in range(0, full, DOT_LANES):
                for j in range(DOT_LANES):
                    product, error = two_product(a[r, start + j], b[n, start + j])
                    lanes_high[j], rounding = two_sum(lanes_high[j], product)
                    lanes_low[j] = lanes_low[j] + (rounding + error)
                    lanes_magnitude[j] = lanes_magnitude[j] + abs(product)
            h, l, m = 0.0, 0.0, 0.0
            for j in range(DOT_LANES):
                h, rounding = two_sum(h, lanes_high[j])
                l = l + (rounding + lanes_low[j])
                m = m + lanes_magnitude[j]
            for k in range(full, K):
                product, error = two_product(a[r, k], b[n, k])
                h, rounding = two_sum(h, product)
                l = l + (rounding + error)
                m = m + abs(product)
            high[r, n], low[r, n] = two_sum(h, l)
            magnitude[r, n] = m
