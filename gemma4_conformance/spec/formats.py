"""The four floating formats under test: exact rounding into them, ULP distances, exact errors.

Every format here is IEEE-style binary floating point, described by its precision ``p`` (significand
bits, the implicit one included) and exponent range.  Rounding goes straight from an mpmath value to
the target with round-to-nearest-even on the integer significand, so there is exactly one rounding
(never through float64 first), with gradual underflow into subnormals and overflow to +-inf.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from mpmath import mpf
from mpmath.libmp import normalize


@dataclass(frozen=True)
class Format:
    name: str
    dtype: np.dtype
    precision: int  # significand bits, implicit bit included
    emin: int  # exponent of the smallest normal number
    emax: int  # exponent of the largest finite number
    bits: int  # storage width
    uint: type  # unsigned integer type of the same width, for bit patterns

    @functools.cached_property  # read for every value rounded
    def max_finite(self) -> float:
        return math.ldexp(2**self.precision - 1, self.emax - self.precision + 1)

    @property
    def smallest_subnormal(self) -> float:
        return math.ldexp(1, self.emin - self.precision + 1)

    @property
    def eps(self) -> float:
        """Unit roundoff u = 2^-p: the largest relative error of one rounding to nearest."""
        return math.ldexp(1, -self.precision)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("float64", np.dtype(np.float64), 53, -1022, 1023, 64, np.uint64),
        Format("float32", np.dtype(np.float32), 24, -126, 127, 32, np.uint32),
        Format("float16", np.dtype(np.float16), 11, -14, 15, 16, np.uint16),
        Format("bfloat16", np.dtype(ml_dtypes.bfloat16), 8, -126, 127, 16, np.uint16),
    )
}


def format_of(dtype) -> Format:
    """The Format of a dtype, a dtype name, or a Format."""
    if isinstance(dtype, Format):
        return dtype
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unsupported floating format {name!r}; expected one of {sorted(FORMATS)}") from None


def _round_scalar(x, f: Format) -> float:
    """Round one real (mpf, int or float) to the nearest value of format f, ties to even."""
    if isinstance(x, float) and x == 0:
        return x  # a float zero keeps its sign (mpf has no -0)
    x = mpf(x) if not isinstance(x, mpf) else x
    sign, man, exp, bc = x._mpf_  # |x| = man * 2^exp, man has bc bits
    if not man:  # zero, or inf or nan (a zero mantissa with an exponent)
        return float(x) if exp else 0.0
    e = exp + bc - 1  # floor(log2 |x|)
    if e < f.emin - f.precision:  # below half the smallest subnormal: a signed zero
        return -0.0 if sign else 0.0
    if e > f.emax:
        return -math.inf if sign else math.inf
    if e >= f.emin:  # a normal result: gmpy2's normalize rounds the mantissa to p bits, ties to even
        if bc > f.precision:
            sign, man, exp, bc = normalize(sign, man, exp, bc, f.precision, "n")
        value = math.ldexp(man, exp) if exp + bc <= 1024 else math.inf  # rounded up past float64's range
        value = value if value <= f.max_finite else math.inf
        return -value if sign else value
    q = max(e, f.emin) - (f.precision - 1)  # exponent of one ULP at |x| (subnormals: fixed at emin)
    if exp >= q:
        n = man << (exp - q)
    else:
        shift = q - exp
        n, rem = man >> shift, man & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and n & 1):
            n += 1
    value = math.ldexp(n, q) if n.bit_length() + q <= 1024 else math.inf
    if value > f.max_finite:
        value = math.inf
    return -value if sign else value


def round_to(x, dtype) -> np.ndarray:
    """Round an exact (mpf/int/float) scalar or array to ``dtype`` with one rounding to nearest even.

    The rounded value is exactly representable in the target, hence in float64, so going through a
    float64 *container* after rounding is exact.  Zeros underflowed from negative values keep their sign.
    """
    f = format_of(dtype)
    arr = np.asarray(x, dtype=object)
    out = np.array([_round_scalar(v, f) for v in arr.ravel()], dtype=np.float64).reshape(arr.shape)
    return out.astype(f.dtype)


def _dyadic(x) -> tuple[int, int] | float:
    """An exact real as (n, e) with x = n * 2^e, or the float itself when it is inf or nan."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return x
        n, d = x.as_integer_ratio()
        return n, 1 - d.bit_length()
    if isinstance(x, int):
        return x, 0
    x = mpf(x) if not isinstance(x, mpf) else x
    sign, man, exp, _ = x._mpf_
    if not man:
        return float(x) if exp else (0, 0)
    man = int(man)  # a Python int (mpmath's may be gmpy2's, whose true division does not round once)
    return (-man if sign else man), int(exp)


def abs_error(got, exact) -> np.ndarray:
    """|got - exact| elementwise, ``got`` floats and ``exact`` exact reals (mpf, int or float, any
    shape alike), computed exactly in integers and rounded once to float64 (subnormals and overflow
    to inf included); inf where either is infinite, nan where either is nan."""
    got = np.asarray(got, dtype=np.float64)
    flat = got.reshape(-1)
    finite = np.isfinite(flat)
    mantissa, exponent = np.frexp(np.where(finite, flat, 0.0))  # got = mantissa * 2^exponent exactly
    ns = np.ldexp(mantissa, 53).astype(np.int64).tolist()
    es = (exponent - 53).tolist()
    out = np.empty(flat.size)
    for i, (n, e, x, ok) in enumerate(zip(ns, es, np.asarray(exact, dtype=object).reshape(-1), finite.tolist())):
        b = x._mpf_ if isinstance(x, mpf) else None
        if ok and b is not None and (b[1] or not b[2]):  # a finite mpf, the oracles' case: inlined
            m, f = (-int(b[1]) if b[0] else int(b[1])), int(b[2])
        else:
            b = _dyadic(x)
            if not ok or isinstance(b, float):  # got or exact infinite or nan
                out[i] = abs(float(flat[i]) - float(x))
                continue
            m, f = b
        out[i] = _difference(n, e, m, f)
    return out.reshape(got.shape)


# Every float64 and every midpoint between two is a multiple of 2^-1075, so the bits of an exact value
# below 2^_FLOOR decide nothing but whether it lies on that grid: an oracle's exp of a huge negative
# number (gelu_tanh far in its tail is 2^-(10^10)) must not cost a shift by its exponent.
_FLOOR = -1200
_HUGE = 1100  # an exact value at or above 2^1100 is farther than 2^1099 from every float64: inf


def _difference(n: int, e: int, m: int, f: int) -> float:
    """|n 2^e - m 2^f| rounded once to float64, where n 2^e is a float64 (so e >= -1127)."""
    if m and f + abs(m).bit_length() > _HUGE:
        return math.inf
    off_grid = False
    if f < _FLOOR:
        cut = _FLOOR - f
        magnitude = abs(m)
        off_grid = magnitude != 0 and (magnitude & -magnitude).bit_length() - 1 < cut  # bits below the floor
        m, f = m >> cut, _FLOOR  # m 2^f lies in [m' 2^F, (m' + 1) 2^F), on its left end iff on the grid
    low = min(e, f)
    d = (n << (e - low)) - (m << (f - low))
    if off_grid:  # n 2^e - m 2^f lies strictly inside (d - 1, d) 2^low, as does the midpoint, and no
        d, low = 2 * d - 1, low - 1  # rounding boundary does: their magnitudes round alike
    d = abs(d)
    try:
        return float(d << low) if low >= 0 else d / (1 << -low)  # int / int rounds correctly
    except OverflowError:
        return math.inf


def _ordinal(a: np.ndarray, f: Format) -> np.ndarray:
    """Map floats to integers in value order: consecutive floats differ by 1, and +0 and -0 both map to 0."""
    bits = np.ascontiguousarray(a, dtype=f.dtype).view(f.uint).astype(np.int64)
    if f.bits == 64:  # the sign bit is the int64 sign; fold negatives onto the negative axis
        mag = bits & np.int64(0x7FFFFFFFFFFFFFFF)
        return np.where(bits < 0, -mag, mag)
    sign = np.int64(1) << (f.bits - 1)
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


def ulp_distance(a, b, dtype=None) -> np.ndarray:
    """Number of representable values between a and b in their format, elementwise, as float64.

    +0 and -0 are equal; a pair straddling zero counts the steps on both sides; +-inf sit one step
    beyond the largest finite value (so an overflowed rounding is one ULP off, not infinitely far);
    NaN against NaN is 0, NaN against anything else is inf.
    """
    f = format_of(dtype if dtype is not None else np.asarray(a).dtype)
    a = np.asarray(a).astype(f.dtype)
    b = np.asarray(b).astype(f.dtype)
    a_nan, b_nan = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
    # Python integers: float64 ordinals on opposite sides of zero differ by up to 2^64.
    d = np.abs(_ordinal(a, f).astype(object) - _ordinal(b, f).astype(object)).astype(np.float64)
    d = np.where(a_nan | b_nan, np.inf, d)
    return np.where(a_nan & b_nan, 0.0, d)


def ulp(x, dtype) -> np.ndarray:
    """Spacing of the format at magnitude |x| (the ULP of a number of that size), as float64.

    Below the normal range the spacing is the smallest subnormal; at or above the largest finite
    value (inf included) it is the spacing of the top binade.
    """
    f = format_of(dtype)
    mag = np.abs(np.asarray(x, dtype=np.float64))
    _, e = np.frexp(np.where(np.isfinite(mag), mag, f.max_finite))  # mag = m * 2^e, m in [0.5, 1)
    e = np.where(mag == 0, f.emin, np.clip(e - 1, f.emin, f.emax))
    return np.ldexp(1.0, e - (f.precision - 1))


def scale_ulp(scale, dtype) -> np.ndarray:
    """The ULP of ``dtype`` at magnitude |scale| for an error model's scale: ``ulp`` without its top.

    A scale is a bound built from an op's terms (a sum of their magnitudes, times a condition number
    such as the logits' size), not a value of the format, so it may pass the largest finite value
    while every rounding it bounds happens in range: the unit is then the spacing the format's
    precision gives at that magnitude.  (``ulp``'s top binade made float16 attention with values near
    65504 and logits near 100, a scale of 3e6, allow 32 per ULP instead of 2048, and failed a correct
    engine that matched a plain float16 arrangement exactly.)  An infinite scale is not finite in any
    unit: it keeps ``ulp``'s top binade, as the verdicts judge infinities on their own.
    """
    f = format_of(dtype)
    mag = np.abs(np.asarray(scale, dtype=np.float64))
    _, e = np.frexp(np.where(np.isfinite(mag), mag, f.max_finite))
    e = np.where(mag == 0, f.emin, np.maximum(e - 1, f.emin))
    return np.ldexp(1.0, e - (f.precision - 1))
