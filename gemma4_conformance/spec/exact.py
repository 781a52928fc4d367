"""Exact inputs, exact sums and the working precision of the oracles.

Every floating input of any format under test is a dyadic rational that float64 holds exactly, so
it becomes an mpf with no rounding.  The oracles then compute at the working precision (in bits),
which defaults to well above float64 and is set with ``precision(bits)``.  Sums of products (dot
products, matrix products, sums of squares) are exact and rounded once: ``dot`` defines them one at
a time, ``dots`` and ``sums_of_squares`` compute many at once with integer matrix products.
``dots_enclosure`` encloses the same products for the judging's first stage: float64 BLAS and an
a-priori bound, or the integer products, with no Python object per sum.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from mpmath import mp, mpf
from mpmath.libmp import from_man_exp, mpf_abs, mpf_add, mpf_mul, mpf_pos, mpf_sub, mpf_sum
from threadpoolctl import ThreadpoolController

from . import compiled

DEFAULT_PRECISION = 128
_precision = DEFAULT_PRECISION


def get_precision() -> int:
    return _precision


@contextlib.contextmanager
def precision(bits: int):
    """Evaluate the oracles inside this block at ``bits`` bits of working precision."""
    global _precision
    if bits < 2:
        raise ValueError(f"working precision must be at least 2 bits, got {bits}")
    saved, _precision = _precision, int(bits)
    try:
        yield
    finally:
        _precision = saved


def _to_mpf(x: np.ndarray) -> np.ndarray:
    """A float64 array as an object array of mpf, exactly: each entry from its 53-bit integer
    mantissa and exponent (half the time of ``mpf(float)`` per entry, the same values)."""
    flat = x.reshape(-1)
    finite = np.isfinite(flat)
    mantissa, exponent = np.frexp(np.where(finite, flat, 0.0))
    make = mp.make_mpf
    out = np.empty(flat.size, dtype=object)
    out[:] = [make(from_man_exp(n, e)) for n, e in
              zip(np.ldexp(mantissa, 53).astype(np.int64).tolist(), (exponent - 53).tolist())]
    for i in np.flatnonzero(~finite):
        out[i] = mpf(float(flat[i]))
    return out.reshape(x.shape)


def exact(x):
    """An input taken exactly: floating arrays become object arrays of mpf, floating scalars mpf.

    Integer and boolean arrays (positions, tokens, masks), Python ints, None and values that are
    already exact (object arrays, mpf) pass through unchanged.
    """
    if is_floating(x):
        return _to_mpf(x.astype(np.float64))
    if isinstance(x, (float, np.floating)):
        return mpf(float(x))
    return x


def is_floating(x) -> bool:
    return isinstance(x, np.ndarray) and (x.dtype.kind == "f" or x.dtype.name == "bfloat16")


def widen(x):
    """Floating arrays of any format under test as float64, which holds them exactly (no copy if they
    are float64 already)."""
    if not is_floating(x):
        return x
    if x.dtype.itemsize == 2 and x.ndim and x.size:
        out = np.empty(x.shape)
        widen_into(x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1]))
        return out
    return x.astype(np.float64, copy=False)


def widened(x):
    """``widen``, once per array inside ``sharing``: the enclosure and the error models read the same
    float64 copy of an argument."""
    return shared("widened", (x,), lambda: widen(x)) if is_floating(x) and x.dtype != np.float64 else x


_FLOAT16_VALUES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)


def widen_into(x: np.ndarray, out: np.ndarray) -> None:
    """A 2-D floating array into the float64 array ``out`` of its shape, exactly."""
    if x.dtype.name == "bfloat16":
        compiled.widen_bfloat16(x.view(np.uint16), out)
    elif x.dtype == np.float16:
        compiled.widen_by_table(x.view(np.uint16), _FLOAT16_VALUES, out)
    else:
        out[...] = x


_depth = 0  # how many oracles are running: the outermost sets the precision, the others inherit it


def oracle(fn: Callable | None = None, *, summed: tuple[str, ...] = ()) -> Callable:
    """Make ``fn`` an oracle: inputs taken exactly, body evaluated at the working precision.

    ``@oracle(summed=("W", "x"))`` names the arguments the body reads only through exact sums
    (``dots``): a floating array there reaches the body as float64, which holds it exactly, rather
    than as an mpf per entry, so a weight matrix of the real model costs no more than its products.

    An oracle called from another runs at its caller's precision, so a composite can raise it for
    a part that needs guard bits (rope's angles).
    """
    if fn is None:
        return functools.partial(oracle, summed=summed)
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _depth
        bound = signature.bind(*args, **kwargs)
        for name, value in bound.arguments.items():
            bound.arguments[name] = widen(value) if name in summed else exact(value)
        with mp.workprec(_precision if _depth == 0 else mp.prec):
            _depth += 1
            try:
                return fn(*bound.args, **bound.kwargs)
            finally:
                _depth -= 1

    return wrapper


def elementwise(f: Callable[..., mpf], *arrays):
    """Apply a scalar mpmath function elementwise to object arrays (or scalars), broadcasting."""
    return np.frompyfunc(f, len(arrays), 1)(*arrays)


def rowwise(f: Callable[[np.ndarray], object], x: np.ndarray) -> np.ndarray:
    """Apply ``f`` to each row ``x[..., :]`` (the last axis); returns an object array of shape x.shape[:-1]."""
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty(rows.shape[0], dtype=object)
    for i, row in enumerate(rows):
        out[i] = f(row)
    return out.reshape(x.shape[:-1])


def dot(a, b, rounded: bool = True) -> mpf:
    """sum_k a_k b_k, exactly (products and sum in integers), then rounded once to the working
    precision; ``rounded=False`` keeps the exact value.  (mpmath's fdot drops terms more than about
    2p bits below the running sum, so it is not used.)  The definition that ``dots`` computes fast."""
    total = mpf_sum([mpf_mul(x._mpf_, y._mpf_) for x, y in zip(a, b)])
    return mp.make_mpf(mpf_pos(total, mp.prec, "n") if rounded else total)


# Exact sums of products at the speed of integer matrix products ----------------------------------------
#
# Every entry is sign * man * 2^exp with an integer man, so a sum of products is an integer times a
# power of two.  ``dots`` puts each operand on one binary grid (every entry an integer multiple of
# 2^low), cuts those integers into bands of w bits, and multiplies every pair of bands as a float64
# matrix product.  That product is exact whatever the order or blocking of its sums: its terms and
# partial sums are integers below K * 2^(w_a + w_b) <= 2^53, all of which float64 holds.  The pairs'
# results are then added exactly, each shifted into place (int64 partials per shift, then base-2^32
# digits, then one Python integer per output), and rounded once.  An mpf operand (a softmax's
# weights at 128 bits) is the sum of grids of its mantissas' 53-bit limbs.
# (FLINT's integer matrix product, python-flint's fmpz_mat, was measured too: making one fmpz per
# entry costs 0.25 to 1.7 us, more than the whole product here, so a real weight would take 20 s.)

_CHUNK = 1 << 17  # entries of the second operand banded at once: a large weight goes through the cache
_LIMB = 53  # bits of a mantissa that an int64 grid takes, and float64 converts exactly
_MANTISSA = (1 << 52) - 1


@dataclass
class _Grid:
    """A 2-D array's entries as sign * man * 2^(low + shift), man an int64 below 2^53 and sign +-1.0;
    every entry is below 2^(low + span) in magnitude.  ``magnitude`` is man * 2^shift when it fits."""

    sign: np.ndarray
    man: np.ndarray
    shift: np.ndarray
    low: int
    span: int
    magnitude: np.ndarray | None = None

    def bands(self, width: int) -> list[tuple[int, np.ndarray]]:
        """(offset, band) for the bands with a nonzero entry: the entries are the sum of
        band * 2^(low + offset) over them, each band a float64 array of integers below 2^width."""
        mask = (1 << width) - 1
        out = []
        for offset in range(0, self.span, width):
            if self.magnitude is not None:
                digit = self.magnitude >> offset
                digit &= mask
            else:  # the bits [offset, offset + width) of man * 2^shift, in int64 without overflow
                shift = self.shift - offset
                left = (self.man & ((1 << np.clip(width - shift, 0, _LIMB)) - 1)) << np.clip(shift, 0, width)
                digit = np.where(shift >= 0, left, (self.man >> np.clip(-shift, 0, 63)) & mask)
            digit = digit.astype(np.float64)
            if digit.any():
                digit *= self.sign
                out.append((offset, digit))
        return out


def _grid(sign: np.ndarray, man: np.ndarray, exp: np.ndarray, size: np.ndarray | None = None) -> _Grid | None:
    """The grid of entries sign * man * 2^exp (int64 man below 2^53, ``size`` its bit length when
    known); None when every entry is zero."""
    common = int(np.bitwise_or.reduce(man, axis=None))
    if common == 0:
        return None
    # no finer than the entries need: the trailing zeros every mantissa has (bf16's 45) go to the grid
    trailing = (common & -common).bit_length() - 1
    if trailing:
        man = man >> trailing
        exp = exp + trailing
        size = None if size is None else size - trailing
    if size is None:
        size = np.frexp(man.astype(np.float64))[1]  # man < 2^53 converts exactly: its bit length
    nonzero = man != 0
    low = int(exp[nonzero].min())
    shift = exp - low
    span = int((shift + size)[nonzero].max())
    magnitude = man << np.where(nonzero, shift, 0) if span <= 62 else None
    return _Grid(sign, man, shift, low, span, magnitude)


def _grids(x: np.ndarray) -> list[_Grid] | None:
    """A 2-D floating or mpf array as a sum of grids (none for zeros); None if an entry is not finite."""
    if x.dtype == object:
        return _mpf_grids(x)
    x = np.ascontiguousarray(x, dtype=np.float64)
    bits = x.view(np.int64)
    field = (bits >> 52) & 0x7FF  # the biased exponent: 0 for zeros and subnormals
    if field.max(initial=0) == 0x7FF:
        return None
    man = bits & _MANTISSA
    man |= np.minimum(field, 1) << 52  # the implicit bit of normal numbers
    size = np.where(field > 0, _LIMB, 0) if field.min(initial=1) > 0 else None  # subnormals: not known
    grid = _grid(np.copysign(1.0, x), man, np.maximum(field, 1) - 1075, size)
    return [grid] if grid is not None else []


def _mpf_grids(x: np.ndarray) -> list[_Grid] | None:
    parts = [v._mpf_ if isinstance(v, mpf) else mpf(v)._mpf_ for v in x.ravel()]
    if any(man == 0 and exp != 0 for _, man, exp, _ in parts):  # inf or nan
        return None
    sign = np.array([-1.0 if negative else 1.0 for negative, _, _, _ in parts]).reshape(x.shape)
    exp = np.array([e for _, _, e, _ in parts], dtype=np.int64).reshape(x.shape)
    limbs = -(-max((size for *_, size in parts), default=0) // _LIMB)
    grids = []
    for j in range(limbs):
        man = np.array([int(m >> (_LIMB * j)) & ((1 << _LIMB) - 1) for _, m, _, _ in parts], dtype=np.int64)
        grid = _grid(sign, man.reshape(x.shape), exp + _LIMB * j)
        if grid is not None:
            grids.append(grid)
    return grids


def _widths(K: int, a: _Grid, b: _Grid, pair_cost: float) -> tuple[int, int]:
    """Band widths with K * 2^(w_a + w_b) <= 2^53 that make the work least: cutting each operand into
    its bands (several array passes per band) against a product per pair of bands."""
    budget = 53 - max(K - 1, 0).bit_length()
    if budget < 2:
        raise ValueError(f"exact sums of {K} terms need a float64 grid of at least 2 bits")

    def work(w_a):
        n_a, n_b = -(-a.span // w_a), -(-b.span // (budget - w_a))
        return 8 * (n_a * a.sign.size + n_b * b.sign.size) + n_a * n_b * pair_cost

    w_a = min(range(1, budget), key=work)
    return w_a, budget - w_a


def _sums(A: list[_Grid], B: list[_Grid], K: int, product: Callable, outputs: int) -> tuple[np.ndarray, int]:
    """The sum over pairs of grids and their pairs of bands of product(band_a, band_b), each shifted
    into place, exactly: Python integers, and the exponent of their unit."""
    digits, unit = _sum_digits(A, B, K, product, outputs)
    total, exponent = digits.integers()
    return total, unit + exponent


def _sum_digits(A: list[_Grid], B: list[_Grid], K: int, product: Callable, outputs: int) -> tuple[_Digits, int]:
    """``_sums`` as base-2^32 digits, and the exponent of their unit."""
    digits = _Digits(outputs)
    if not A or not B:  # an operand of zeros
        return digits, 0
    unit = min(a.low for a in A) + min(b.low for b in B)
    partial: dict[int, np.ndarray] = {}  # products at one shift add exactly in int64: each is below 2^53
    count: Counter = Counter()
    for a in A:
        for b in B:
            w_a, w_b = _widths(K, a, b, pair_cost=outputs * K / 4)
            bands_b = b.bands(w_b)
            for offset_a, band_a in a.bands(w_a):
                for offset_b, band_b in bands_b:
                    shift = a.low + b.low - unit + offset_a + offset_b
                    if count[shift] == 1 << 10:  # 2^10 of them: move them to the digits
                        digits.add(partial.pop(shift), shift)
                        count[shift] = 0
                    partial[shift] = partial.get(shift, 0) + product(band_a, band_b).reshape(-1).astype(np.int64)
                    count[shift] += 1
    for shift, part in partial.items():
        digits.add(part, shift)
    return digits, unit


class _Digits:
    """An exact sum of int64 arrays times powers of two, kept as base-2^32 digits in int64 arrays:
    each addition puts pieces below 2^32 in magnitude into a digit, so a digit holds 2^31 additions
    before it could overflow, far more than the shifts of any sum here."""

    BITS = 32
    MASK = (1 << BITS) - 1

    def __init__(self, outputs: int):
        self.digits: dict[int, np.ndarray] = {}
        self.outputs = outputs

    def _put(self, j: int, piece: np.ndarray) -> None:
        if j in self.digits:
            self.digits[j] += piece
        else:
            self.digits[j] = piece.copy()

    def add(self, part: np.ndarray, shift: int) -> None:
        """+= part * 2^shift, part int64."""
        j, r = divmod(shift, self.BITS)
        # part = high 2^32 + low, low in [0, 2^32) and |high| < 2^31: shifted by r < 32, each stays in int64
        for k, piece in ((j, (part & self.MASK) << r), (j + 1, (part >> self.BITS) << r)):
            self._put(k, piece & self.MASK)
            self._put(k + 1, piece >> self.BITS)

    def _carried(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Digits in [0, 2^32) (uint32 [outputs, n], lowest first) of the sums plus 2^(32 n) where a sum
        is negative, that mask, and the lowest digit's index."""
        low, high = min(self.digits), max(self.digits)
        n = high - low + 2  # a digit more for the last carry
        out = np.empty((self.outputs, n), dtype=np.uint32)
        carry = np.zeros(self.outputs, dtype=np.int64)
        for i in range(n):  # carries propagate upward: every digit ends in [0, 2^32)
            d = self.digits.get(low + i, 0) + carry
            carry = d >> self.BITS
            out[:, i] = d & self.MASK
        # The carry out of the top is the sign: -1 where the digits hold 2^(32 n) plus a negative sum.
        return out, carry < 0, low

    def integers(self) -> tuple[np.ndarray, int]:
        """The sums as Python integers (an object array) times 2^exponent, and the exponent."""
        if not self.digits:
            return np.zeros(self.outputs, dtype=object), 0
        out, negative, low = self._carried()
        n = out.shape[1]
        raw = memoryview(out.tobytes())
        size = 4 * n
        offset = 1 << (self.BITS * n)
        result = np.empty(self.outputs, dtype=object)
        result[:] = [v - offset if neg else v for v, neg in
                     zip((int.from_bytes(raw[i * size:(i + 1) * size], "little") for i in range(self.outputs)),
                         negative.tolist())]
        return result, self.BITS * low


    WINDOW = 4  # digits read below a sum's top digit: 128 bits, past any working format's precision

    def floats(self, exponent: int, work) -> tuple[np.ndarray, np.ndarray]:
        """The sums times 2^exponent in the floating type ``work`` as (mid, rad) with |sum - mid| <= rad,
        without a Python object per sum: each magnitude's top WINDOW digits, added in ``work`` (two
        roundings past the first, each u relative), and the bits below them (under 2^-96 of it).  rad is
        0 for a sum that is 0, and inf where ``work``'s range cannot hold the sum."""
        mid = np.zeros(self.outputs, dtype=work)
        if not self.digits:
            return mid, np.zeros_like(mid)
        out, negative, low = self._carried()
        digits = out.astype(np.int64)
        # magnitudes: a negative sum's digits are 2^(32 n) - |sum|, so |sum| = (MASK - digits) + 1
        complement = self.MASK - digits[negative]
        carry = np.ones(len(complement), dtype=np.int64)
        for i in range(digits.shape[1]):
            complement[:, i] += carry
            carry = complement[:, i] >> self.BITS
            complement[:, i] &= self.MASK
        digits[negative] = complement
        nonzero = digits != 0
        n = digits.shape[1]
        top = n - 1 - np.argmax(nonzero[:, ::-1], axis=1)  # index of each sum's top digit
        rows = np.arange(self.outputs)
        value = np.zeros(self.outputs, dtype=work)
        for j in range(self.WINDOW):
            i = top - j
            value = value * work(2.0 ** self.BITS) + np.where(i >= 0, digits[rows, np.maximum(i, 0)], 0).astype(work)
        below = (np.cumsum(nonzero, axis=1) > 0)[rows, np.maximum(top - self.WINDOW, 0)] & (top >= self.WINDOW)
        zero = ~nonzero.any(axis=1)
        with np.errstate(over="ignore", under="ignore"):
            mid = np.ldexp(value, (self.BITS * (low + top - self.WINDOW + 1) + exponent).astype(np.int32))
        mid = np.where(negative, -mid, mid)
        u = np.finfo(work).eps / 2
        rad = np.abs(mid) * work(3 * u * (1 + 4 * u)) + np.where(below, np.abs(mid) * work(2.0 ** -95), 0)
        representable = np.isfinite(mid) & (np.abs(mid) >= np.finfo(work).smallest_normal)
        rad = np.where(zero, 0, np.where(representable, rad, np.inf)).astype(work)
        return np.where(zero, 0, mid).astype(work), rad


@functools.cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()


_limited = 0  # depth of one_blas_thread blocks: an inner one costs nothing


@contextlib.contextmanager
def one_blas_thread():
    """BLAS on one thread inside this block.  The judge's products are small and many: BLAS threads
    would only contend (with each other, with the backend's and pytest-xdist's workers, with whatever
    else the machine runs), and spin doing it (a product of 2 rows took 13 times the CPU time)."""
    global _limited
    if _limited:
        yield
        return
    with _blas().limit(limits=1, user_api="blas"):
        _limited += 1
        try:
            yield
        finally:
            _limited -= 1


def _from_integers(total: np.ndarray, exponent: int, rounded: bool) -> np.ndarray:
    prec = mp.prec
    if rounded:
        return np.frompyfunc(lambda m: mp.make_mpf(from_man_exp(m, exponent, prec, "n")), 1, 1)(total)
    return np.frompyfunc(lambda m: mp.make_mpf(from_man_exp(m, exponent)), 1, 1)(total)


def dots(a: np.ndarray, b: np.ndarray, scale=None, rounded: bool = True) -> np.ndarray:
    """``scale * sum_k a[..., k] * b[n, k]`` for every row of ``a [..., K]`` and row ``n`` of ``b [N, K]``
    (-> ``[..., N]``): exact, then rounded once to the working precision, bit for bit ``dot``'s value;
    ``rounded=False`` keeps the exact values.  Entries are floating (taken exactly) or mpf; ``scale``
    is None or an exact number (an input of the op)."""
    K, N = a.shape[-1], b.shape[0]
    rows = a.reshape(math.prod(a.shape[:-1]), K)
    factor = (mpf(1) if scale is None else mpf(scale))._mpf_
    kept, floors = (_truncated(rows, mp.prec + _GUARD + K.bit_length()) if rounded and rows.dtype == object
                    else (rows, None))
    A = _grids(kept)
    out = np.empty((rows.shape[0], N), dtype=object)
    step = max(1, _CHUNK // max(K, 1))
    with one_blas_thread():
        for start in range(0, N, step):
            _dots_block(rows, floors, b[start:start + step], A, factor, rounded, out[:, start:start + step])
    return out.reshape(a.shape[:-1] + (N,))


# An mpf row's entries may span far more bits than its rounded sums can see: a softmax's weights reach
# exp(-5e4), 2^-77000 below the row's largest.  Banding that span costs thousands of products, so the
# bits of a row below 2^(top - prec - _GUARD - log2 K) are dropped first; the dropped part of a sum is
# below K * 2^floor * max|b|, and a sum is kept only where both ends of that interval round alike
# (rounding is monotone, so the exact sum rounds the same), else it is summed by the definition.
# The guard puts the cut where banding a row costs about what checking its sums' intervals does
# (measured: a row is cut once its weights reach about 100 nats below its largest at 128 bits); the
# definition is then needed only where the kept bits cancel or tie to within 2^-128 of a sum.
_GUARD = 128


def _truncated(rows: np.ndarray, keep: int) -> tuple[np.ndarray, list[int | None]]:
    """mpf rows with the bits below each row's largest entry's top less ``keep`` dropped (toward 0),
    and per row the exponent ``floor`` under which bits were dropped, None where none were."""
    out = rows
    floors: list[int | None] = []
    for r, row in enumerate(rows):
        parts = [v._mpf_ if isinstance(v, mpf) else mpf(v)._mpf_ for v in row]
        floor = max((e + size for _, m, e, size in parts if m), default=0) - keep
        if all(e >= floor for _, m, e, _ in parts if m):  # mpf mantissas are odd: no bit below floor
            floors.append(None)
            continue
        if out is rows:
            out = rows.copy()
        for k, (negative, m, e, _) in enumerate(parts):
            if m and e < floor:
                out[r, k] = mp.make_mpf(from_man_exp(-(m >> (floor - e)) if negative else m >> (floor - e), floor))
        floors.append(floor)
    return out, floors


def _dots_block(rows, floors, block, A, factor, rounded, out) -> None:
    """``dots`` against a block of b's rows, into ``out``; ``A`` holds ``rows`` after ``_truncated``,
    whose ``floors`` say where bits were dropped (None: nowhere)."""
    B = _grids(block) if A is not None else None
    if B is None or factor[1] == 0 and factor[2] != 0:  # an inf or nan: the definition, term by term
        out[...] = _dots_by_definition(rows, block, factor, rounded)
        return
    total, unit = _sums(A, B, rows.shape[1], lambda x, y: x @ y.T, rows.shape[0] * block.shape[0])
    total = total * ((-1) ** factor[0] * int(factor[1]))
    out[...] = _from_integers(total, unit + factor[2], rounded).reshape(out.shape)
    if floors is None or not any(f is not None for f in floors):
        return
    total = total.reshape(out.shape)
    largest = ([max((abs(v) for v in col), default=mp.zero)._mpf_ for col in block] if block.dtype == object
               else [mpf(float(x))._mpf_ for x in np.abs(widen(block)).max(axis=1, initial=0)])
    size = mpf_mul(from_man_exp(rows.shape[1], 0), mpf_abs(factor))
    for r in (r for r, f in enumerate(floors) if f is not None):
        for n, top in enumerate(largest):
            value = from_man_exp(total[r, n], unit + factor[2])
            error = mpf_mul(mpf_mul(size, top), from_man_exp(1, floors[r]))
            low, high = mpf_sub(value, error, mp.prec, "n"), mpf_add(value, error, mp.prec, "n")
            out[r, n] = mp.make_mpf(low) if low == high else _dots_by_definition(
                rows[r:r + 1], block[n:n + 1], factor, rounded)[0, 0]


def _dots_by_definition(rows, block, factor, rounded) -> np.ndarray:
    rows, block = exact(rows) if rows.dtype != object else rows, exact(block) if block.dtype != object else block
    out = np.empty((rows.shape[0], block.shape[0]), dtype=object)
    for t, row in enumerate(rows):
        for n, col in enumerate(block):
            value = mpf_mul(factor, dot(list(row), list(col), rounded=False)._mpf_)
            out[t, n] = mp.make_mpf(mpf_pos(value, mp.prec, "n") if rounded else value)
    return out


def sums_of_squares(x: np.ndarray) -> np.ndarray:
    """``sum_k x[..., k]^2`` for every row of ``x [..., K]`` (-> ``[...]``): exact, then rounded once to
    the working precision, bit for bit ``dot(row, row)``."""
    K = x.shape[-1]
    rows = x.reshape(math.prod(x.shape[:-1]), K)
    X = _grids(rows)
    if X is None:  # an inf or nan: the definition, term by term
        rows = exact(rows) if rows.dtype != object else rows
        return rowwise(lambda row: dot(row, row), rows).reshape(x.shape[:-1])
    with one_blas_thread():
        total, unit = _sums(X, X, K, lambda u, v: np.einsum("rk,rk->r", u, v), rows.shape[0])
    return _from_integers(total, unit, True).reshape(x.shape[:-1])


# Sums of products as enclosures at the speed of BLAS (spec.enclosures, the judging's first stage) --------
#
# The bound.  Let s = sum_k a_k b_k and T = sum_k |a_k b_k| over K terms, and let the products be
# summed in a format of unit roundoff u, in any order, blocking or use of FMA (BLAS's choice).
# - Operands of at most 24 significand bits and exponents of float32's range (bf16, fp16, float32)
#   widen exactly to float64, and their products are exact there: 48 bits at most, magnitudes in
#   [2^-298, 2^256], far inside float64's normal range, so no product underflows or overflows, and
#   a sum of 15360 of them stays below 2^270.  Each addition (or FMA) then rounds once, relative error
#   at most u, and an addition whose result is subnormal is exact: |fl(s) - s| <= gamma_(K-1) T,
#   gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability, 2nd ed., eq. 3.5 and section 4.2).
# T itself is computed the same way from |a| and |b|, all terms >= 0 and exact: T^ >= (1 - gamma_K) T,
# so T <= T^ / (1 - gamma_K), and the radius is rad = gamma_K / (1 - gamma_K) T^, rounded up (the
# constant rounded up, then 2^-40 relative for the product that computes rad).  A non-finite operand
# makes T^ inf or nan: rad is inf there.  A zero T^ is an exactly zero sum: rad is 0.
# float64 operands: their products are not exact in float64, and in long double (u = 2^-64) the bound
# gamma_K T is a few float64 ULPs of T at K = 3840, which leaves the printed digits of a float64
# result's largest error to the oracle nearly everywhere.  So each sum is a double-double h + l
# (``compiled.dot_sums``: every product's and every addition's error kept exactly, by FMA and TwoSum,
# and summed into l), ``_double_double_dots_enclosure``:
# - Terms.  fl(a b) + fma(a, b, -fl(a b)) = a b and TwoSum's s + e = x + y exactly (Ogita, Rump and
#   Oishi, Accurate sum and dot product, 2005, sections 2 and 3), so s = h + sum of the errors.  Each
#   product's error is at most u |fl(a b)|, each addition's at most u times its partial sum, which is at
#   most (1 + gamma_n) T: with the K + DOT_LANES additions of the K terms and of the lanes, the errors'
#   magnitudes sum to at most gamma_n T, n = K + DOT_LANES + 2.
# - Their sum.  l sums them in a tree in which each passes through at most n additions: it errs by at
#   most gamma_n of that, so |h + l - s| <= gamma_n^2 T (their Proposition 5.5, with lanes).
# - T.  m, the computed sum of |fl(a b)| (nonnegative terms, through the same n additions at most), is
#   at least (1 - gamma_n) sum |fl(a b)|, and |a b| <= (1 + u) |fl(a b)|: T <= (1 + u) m / (1 - gamma_n).
# - Underflow.  Additions stay exact or within u relative (a subnormal sum is exact), TwoSum stays
#   exact; a product whose error lies below 2^-1074 loses at most 2^-1075: 2^-1074 K in all, doubled.
# - Overflow.  Where m <= 2^1000 no product or partial sum overflows; elsewhere (m inf or nan for
#   a non-finite operand) the exact integer sums take them.
# - Long double.  h + l is rounded once to long double: u64 |mid| more.
# So rad = c m + 2^-1073 K + u64 |mid|, c = gamma_n^2 (1 + u) / (1 - gamma_n) rounded up: about
# u64 |mid| unless T is 2^22 |mid| or more (at K = 15360; more at smaller K), where the exact sums take it
# (``_LOOSE``).

_BLAS_BLOCK = 1 << 17  # entries of b widened at once: a block stays in the cache for its products
_ROUNDING = 1 + 2.0**-40  # the roundings of computing rad, each at most u relative


def _narrow(x: np.ndarray) -> bool:
    """Entries of a format whose products are exact in float64 (at most 24 significand bits and
    float32's exponent range): bf16, fp16, float32."""
    return x.dtype != object and x.dtype.itemsize <= 4


def _radius_factor(K: int) -> float:
    """c: rad = c T^ bounds |fl(s) - s| for K exact products summed in float64 (above)."""
    u = Fraction(1, 2**53)
    gamma = K * u / (1 - K * u)
    return math.nextafter(float(gamma / (1 - gamma)), math.inf) * _ROUNDING


def dots_enclosure(a: np.ndarray, b: np.ndarray, work, kept: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``sum_k a[..., k] * b[n, k]`` for floating ``a [..., K]`` and ``b [N, K]`` as (mid, rad) in the
    floating type ``work``, |exact - mid| <= rad: for bf16, fp16 and float32 operands float64 matrix
    products (BLAS, ``products``) and the a-priori bound above, for float64 ones their double-double
    sums (``_double_double_dots_enclosure``), for mpf ones the exact integer sums of ``dots``.  rad is inf
    where an operand is not finite.  ``kept``: whether the products are shared (``products``)."""
    K, N = a.shape[-1], b.shape[0]
    rows = a.reshape(math.prod(a.shape[:-1]), K)
    shape = a.shape[:-1] + (N,)
    if not (_narrow(rows) and _narrow(b)):
        wide = rows.dtype != object and b.dtype != object
        mid, rad = _double_double_dots_enclosure(rows, b, work, kept) if wide else _exact_dots_enclosure(rows, b, work)
        return mid.reshape(shape), rad.reshape(shape)
    mid, total, _ = products(rows, b, kept=kept)
    with np.errstate(all="ignore"):
        rad = np.where(np.isfinite(total) & np.isfinite(mid), total * _radius_factor(K), np.inf)
    return mid.astype(work).reshape(shape), rad.astype(work).reshape(shape)


_shared: dict | None = None  # results computed once inside ``sharing``: key -> (operands, result)


@contextlib.contextmanager
def sharing(apart: bool = False):
    """Inside this block ``shared`` computes each result once: the judging opens one per assessment, whose
    enclosure and error models read the same products of a weight and the same softmax.  Nested, it
    shares the outer block's results, or, ``apart``, keeps its own (a block of an output judged a part at a
    time: kept to the end, the parts' results would add up to the whole output's)."""
    global _shared
    outer, _shared = _shared, {} if _shared is None or apart else _shared
    try:
        yield
    finally:
        _shared = outer


def shared(name: str, operands: tuple, compute: Callable | None = None):
    """``compute()`` once per ``name`` and ``operands`` inside ``sharing`` (always outside it): arrays by
    identity (the block keeps them, so no id is reused, and an assessment does not change its arguments),
    anything else hashable by value.  Without ``compute``, the result if it is known, else None."""
    if _shared is None:
        return compute() if compute is not None else None
    key = (name, *(x if _hashable(x) else ("object", id(x)) for x in operands))
    known = _shared.get(key)
    if known is None:
        if compute is None:
            return None
        known = _shared[key] = (operands, compute())
    return known[1]


def _hashable(x) -> bool:
    if isinstance(x, np.ndarray):
        return False
    try:
        hash(x)
    except TypeError:
        return False
    return True


def products(a: np.ndarray, b: np.ndarray, signed: bool = True,
             kept: bool = True) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(a @ b.T where ``signed``, else None; |a| @ |b|.T; the row sums of |b|) in float64 for a [R, K]
    and b [N, K] of any floating format, by BLAS, through b widened in blocks of rows that stay in the
    cache for all three (widened whole, b would be its size again four times over: 470 MB at 15360 x
    3840); once per b and values of a inside ``sharing``.  For bf16, fp16 and float32 operands the first
    two are ``dots_enclosure``'s mid and T^; for float64 ones, where ``dots_enclosure`` ran first in the
    block, its double-double sums rounded to float64 and m (``_double_double_dots_enclosure``).  Not
    ``kept``, they are computed and not shared (products no one else reads: attention's logits, which
    at a real-size prefill are gigabytes a key-value head)."""
    wide = np.ascontiguousarray(widen(a))
    if not kept:
        return _products(wide, b, signed)
    operands = (b, wide.tobytes(), wide.shape)
    known = None if signed else shared("signed products", operands)
    if known is not None:
        return known
    return shared("signed products" if signed else "products", operands, lambda: _products(wide, b, signed))


def _products(wide: np.ndarray, b: np.ndarray, signed: bool):
    N, K = b.shape
    magnitude = np.concatenate([np.abs(wide), np.ones((1, K))])  # the last row sums |b|'s rows
    mid = np.empty((len(wide), N)) if signed else None
    absolute = np.empty((len(magnitude), N))
    step = max(1, _BLAS_BLOCK // max(K, 1))
    block = np.empty((min(step, N), K))  # one allocation: a fresh one per block costs its page faults
    with one_blas_thread(), np.errstate(all="ignore"):
        for start in range(0, N, step):
            part = block[:min(step, N - start)]
            widen_into(b[start:start + step], part)
            if signed:
                np.matmul(wide, part.T, out=mid[:, start:start + step])
            np.abs(part, out=part)
            np.matmul(magnitude, part.T, out=absolute[:, start:start + step])
    return mid, absolute[:-1], absolute[-1]


# A radius past this share of |mid| (the double-double sums hold about u |mid|, u = 2^-64) means the sum
# cancels far (above): the exact sums take it.
_LOOSE = 2.0**-56
_FINITE = 2.0**1000  # m at most this: no product or partial sum of a double-double sum overflows
_UNDERFLOW = 2.0**-1073  # what a product's underflow may cost a double-double sum, doubled (above)


def _double_double_factor(K: int) -> float:
    """c: c m bounds |h + l - s| for a double-double sum of K products (above)."""
    u = Fraction(1, 2**53)
    n = K + compiled.DOT_LANES + 2
    gamma = n * u / (1 - n * u)
    return math.nextafter(float(gamma**2 * (1 + u) / (1 - gamma)), math.inf) * _ROUNDING


def double_double_dots(rows: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
    """The double-double sums sum_k rows[r, k] b[n, k] of floating rows [R, K] and b [N, K] (``compiled.dot_sums``,
    above), as (high, low, m, the row sums of |b|): high + low [R, N] normalised (|low| <= ULP(high) / 2)."""
    K, N, R = rows.shape[-1], b.shape[0], rows.shape[0]
    rows = np.ascontiguousarray(widen(rows))
    high, low, magnitude, sums = np.empty((R, N)), np.empty((R, N)), np.empty((R, N)), np.empty(N)
    step = max(N, 1) if b.dtype == np.float64 else max(1, _BLAS_BLOCK // max(K, 1))  # narrow b: a block at once
    for start in range(0, N, step):
        columns = slice(start, start + step)
        compiled.dot_sums(rows, np.ascontiguousarray(widen(b[columns])), high[:, columns], low[:, columns],
                          magnitude[:, columns], sums[columns])
    return high, low, magnitude, sums


def double_double_radius(K: int, magnitude: np.ndarray) -> np.ndarray:
    """c m + 2^-1073 K (above), |h + l - s| at most, for the double-double sums of K products whose m is
    ``magnitude``, rounded up (1 + 2^-50 holds its own two roundings); inf where m is past 2^1000 or not
    finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(magnitude <= _FINITE, (_double_double_factor(K) * magnitude + _UNDERFLOW * K) * (1 + 2.0**-50),
                        np.inf)


def _double_double_dots_enclosure(rows: np.ndarray, b: np.ndarray, work,
                                  kept: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``dots_enclosure`` for float64 operands from their double-double sums (``double_double_dots``); where a
    sum may overflow, an operand is not finite, or the sum cancels too far for the radius (``_LOOSE``), the
    rows and columns it is in keep the exact integer sums.  Inside ``sharing`` the sums rounded to
    float64, m and the row sums of |b| are what ``products`` gives for these operands: the error models
    read them instead of computing float64 BLAS products again."""
    K = rows.shape[-1]
    rows = np.ascontiguousarray(widen(rows))
    high, low, magnitude, sums = double_double_dots(rows, b)
    u = np.longdouble(np.finfo(np.longdouble).eps) / 2
    with np.errstate(over="ignore", invalid="ignore"):
        total = high.astype(np.longdouble) + low
        mid = total.astype(work)
        bound = double_double_radius(K, magnitude).astype(np.longdouble) + u * np.abs(total)
        bound = bound * np.longdouble(1 + 2.0**-50)
        rad = np.where(np.isfinite(bound), (bound + np.abs(total - mid.astype(np.longdouble))) *
                       np.longdouble(1 + 2.0**-50), np.inf).astype(work)
        loose = ~(rad <= _LOOSE * np.abs(mid))
    if loose.any():  # the rows' and columns' exact integer sums
        inner, outer = np.flatnonzero(loose.any(axis=1)), np.flatnonzero(loose.any(axis=0))
        part = np.ix_(inner, outer)
        mid[part], rad[part] = _exact_dots_enclosure(rows[inner], widen(b[outer]), work)
    if kept:
        shared("signed products", (b, rows.tobytes(), rows.shape), lambda: (high + low, magnitude, sums))
    return mid, rad


def _exact_dots_enclosure(rows: np.ndarray, b: np.ndarray, work) -> tuple[np.ndarray, np.ndarray]:
    """``dots_enclosure`` from the exact integer sums of ``dots`` (``_Digits.floats``), never a Python
    object per sum."""
    K, N = rows.shape[-1], b.shape[0]
    mid = np.zeros((rows.shape[0], N), dtype=work)
    rad = np.full((rows.shape[0], N), np.inf, dtype=work)
    A = _grids(rows)
    step = max(1, _CHUNK // max(K, 1))
    with one_blas_thread():
        for start in range(0, N, step):
            block = b[start:start + step]
            B = _grids(block) if A is not None else None
            if B is None:
                continue
            digits, unit = _sum_digits(A, B, K, lambda x, y: x @ y.T, rows.shape[0] * block.shape[0])
            m, r = digits.floats(unit, work)
            mid[:, start:start + step] = m.reshape(rows.shape[0], -1)
            rad[:, start:start + step] = r.reshape(rows.shape[0], -1)
    return mid, rad
