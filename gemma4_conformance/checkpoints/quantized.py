"""Weight formats: GGUF's block formats ``q8_0``, ``q4_0``, ``q4_k`` and ``q6_k``, as llama.cpp defines
them (``ggml-common.h`` for the block layouts, ``dequantize_row_*`` in ``ggml-quants.c`` for the values),
fp8: ``fp8_e4m3_channel`` and ``fp8_e4m3_tensor``, float8_e4m3fn values with a float32 scale per
row (output channel) or per tensor, as vLLM's and compressed-tensors' fp8 checkpoints hold them; and int4
with group scales: ``int4_g128`` and ``int4_g32``, as AWQ (``zero_point=True``) and GPTQ (``sym=False``)
checkpoints hold weights, per group of G consecutive input features of a row an fp16 scale s and a 4-bit
zero point z, x = s * (q - z) with a 4-bit unsigned q.  GGUF has neither: fp8 and int4 are stored in the
suite's own row layout (``ScaledFp8``, ``_int4_group``).

A quantized tensor is exactly a set of real numbers: per block of values a scale (and, in ``q4_k``, a
minimum) times small integers. Those numbers are the weights an engine running the file computes
with, so they are the spec's W: ``WeightFormat.dequantize`` returns them exactly, in float64.

Why float64 holds every value exactly. An fp16 scale is ``a * 2^e`` with an integer ``0 <= a < 2^11``
and ``-24 <= e <= 5`` (65504 = 2047 * 2^5; the subnormals are ``a * 2^-24``, ``a < 2^10``).

* ``q8_0``: ``d * q``, ``|q| <= 128``: ``a * |q| < 2^19``.
* ``q4_0``: ``d * (q - 8)``, ``|q - 8| <= 8``: ``< 2^14``.
* ``q6_k``: ``d * sc * (q - 32)``, ``|sc| <= 128`` (int8), ``|q - 32| <= 32``: ``< 2^23``.
* ``q4_k``: ``d * sc * q - dmin * m``, ``0 <= sc, m <= 63``, ``0 <= q <= 15``: the two products are
  ``A * 2^e`` and ``B * 2^f`` with ``A <= 2047 * 63 * 15 < 2^21``, ``B <= 2047 * 63 < 2^17``. Their
  difference is ``2^g`` (``g = min(e, f)``) times the integer ``A * 2^(e-g) - B * 2^(f-g)``, and
  ``|e - f| <= 29``, so that integer is below ``2^21 * 2^29 + 2^17 * 2^29 < 2^51``.

* fp8: ``s * q``, s a float32 (24 significant bits), q an e4m3fn value (4): ``< 2^28``.
* int4: ``s * (q - z)``, an fp16 s, ``0 <= q, z <= 15``: ``q - z`` is an exact integer, ``|q - z| <= 15``,
  and ``a * |q - z| < 2^15``.

Every product and the difference are below 2^53 in units of their last bit, so each float64
operation above is exact (IEEE arithmetic returns the exact result when it is representable).
llama.cpp and the ``gguf`` package compute in float32: ``q8_0``, ``q4_0`` and ``q6_k`` values fit in
float32's 24 bits, so theirs are these values; a ``q4_k`` value may not, and theirs is its rounding to
float32 (two exact products, then one rounded subtraction, or one fused multiply-add). The engine's
integer dot products (``ggml_vec_dot_q4_K_q8_K``) use the exact values, which is why W is kept in
float64. tests/test_quantized.py checks all of this bit for bit against ``gguf``'s dequantization.

The quantizers (``WeightFormat.quantize``) are this module's own: ``gguf`` has none for the k-quants,
and the suite does not need the ``gguf`` package at run time (the tests use it as the independent
reference). They choose scales by each block's range, more simply than llama-quantize's search for
the best scales; that is no loss here, since W is whatever the blocks hold, not the values quantized.
``q8_0`` and ``q4_0`` follow llama.cpp's reference quantizers (``quantize_row_*_ref``); int4 follows
AWQ's pseudo-quantizer (``pseudo_quantize_tensor``): by each group's min and max.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np

__all__ = ["WeightFormat", "ScaledFp8", "QuantizedWeight", "WEIGHT_FORMATS", "UnknownWeightFormat", "weight_format", "FP8_TYPES",
           "FP8_ACTIVATIONS", "FP8_WEIGHTS", "fp8_scale", "fp8_quantized", "rounded_to_fp8", "ACTIVATION_ROUNDINGS",
           "rounded_activations", "stored_in_fp8", "read_from_fp8"]

QK_K = 256  # values per k-quant super-block


@dataclass(frozen=True)
class WeightFormat:
    """One block format: ``block`` values stored in ``block_bytes`` bytes, blocks running along a row."""

    name: str
    block: int
    block_bytes: int
    ggml_type: str | None                            # the name of the type in GGML and GGUF (int4: none)
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]  # uint8 [n, block_bytes] -> float64 [n, block]
    quantize_blocks: Callable[[np.ndarray], np.ndarray]    # float32 [n, block] -> uint8 [n, block_bytes]
    whole_tensors: ClassVar[bool] = False  # its blocks are quantized apart, so a writer may stream them

    @property
    def stores(self) -> str:
        return f"matrices whose rows are multiples of {self.block} values"

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``shape`` can be stored: a matrix whose rows are whole blocks."""
        return len(shape) == 2 and shape[1] > 0 and shape[1] % self.block == 0

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The uint8 array a ``shape`` tensor is stored as: each row its blocks' bytes."""
        return shape[0], shape[1] // self.block * self.block_bytes

    def dequantize(self, stored: np.ndarray) -> np.ndarray:
        """The exact values (float64, ``[rows, columns]``) of the blocks ``stored`` (uint8 ``[rows, row bytes]``)."""
        rows = stored.shape[0]
        blocks = np.ascontiguousarray(stored, dtype=np.uint8).reshape(-1, self.block_bytes)
        return self.dequantize_blocks(blocks).reshape(rows, -1)

    def quantize(self, values: np.ndarray) -> np.ndarray:
        """The blocks (uint8 ``[rows, row bytes]``) that store ``values`` (``[rows, columns]``), rounded."""
        values = np.asarray(values, dtype=np.float32)
        if not self.fits(values.shape):
            raise ValueError(f"{self.name} stores {self.stores}, not shape {list(values.shape)}")
        blocks = self.quantize_blocks(values.reshape(-1, self.block))
        return blocks.reshape(self.stored_shape(values.shape))


# ---- fp8 with dynamic float32 scales: the weights' format and the products' activations ---------------

FP8_TYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
# Declared activation formats in fp8 (adapters.DECLARED_FORMATS) -> (fp8 kind, one scale per token or one per
# tensor), as torch._scaled_mm's and vLLM's dynamic fp8 linears scale x
FP8_ACTIVATIONS = {"fp8_e4m3_token": ("e4m3", True), "fp8_e4m3_tensor": ("e4m3", False),
                   "fp8_e5m2_token": ("e5m2", True), "fp8_e5m2_tensor": ("e5m2", False)}


def fp8_scale(x: np.ndarray, kind: str, per_row: bool) -> np.ndarray:
    """The dynamic scale max |x| / M in float32, M the format's largest value, per row along the last axis
    (keeping it, size 1) or of the whole tensor (every axis size 1); 1 for a group of zeros."""
    magnitude = np.abs(np.asarray(x, dtype=np.float32))
    a = magnitude.max(axis=-1, keepdims=True) if per_row else magnitude.max(keepdims=True)
    s = a / np.float32(ml_dtypes.finfo(FP8_TYPES[kind]).max)
    return np.where(s > 0, s, np.float32(1)).astype(np.float32)


def fp8_quantized(x: np.ndarray, kind: str, scale: np.ndarray) -> np.ndarray:
    """q = fp8(x / scale), the quotient in float32 and clamped to the format's range first (vLLM's
    scaled_fp8_quant saturates; only a scale not taken from x can need it)."""
    largest = np.float32(ml_dtypes.finfo(FP8_TYPES[kind]).max)
    return np.clip(np.asarray(x, dtype=np.float32) / scale, -largest, largest).astype(FP8_TYPES[kind])


def rounded_to_fp8(x: np.ndarray, kind: str, per_row: bool) -> np.ndarray:
    """x^ = s q exactly (float64: 24 + 4 significant bits), the value an fp8 GEMM's scaled products see."""
    scale = fp8_scale(x, kind, per_row)
    return fp8_quantized(x, kind, scale).astype(np.float64) * scale.astype(np.float64)


@dataclass(frozen=True)
class ScaledFp8:
    """float8_e4m3fn values and a float32 scale per row (``per_row``: an output channel) or per tensor.
    Stored as the suite's own layout, like the blocks: each row is its scale's 4 bytes (little-endian;
    a per-tensor matrix repeats its one scale) then its values' bytes.  The scale is max |row| / 448 (or
    the tensor's), computed in float32, and q = fp8(x / s) (``fp8_scale``, ``fp8_quantized``), as vLLM
    quantizes."""

    name: str
    per_row: bool
    ggml_type: ClassVar[None] = None  # GGUF has no fp8 type
    whole_tensors: ClassVar[bool] = True  # a per-tensor scale reads the whole tensor
    stores: ClassVar[str] = "matrices"

    def fits(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and shape[1] > 0

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return shape[0], shape[1] + 4

    def dequantize(self, stored: np.ndarray) -> np.ndarray:
        stored = np.ascontiguousarray(stored, dtype=np.uint8)
        scale = stored[:, :4].copy().view("<f4").astype(np.float64)
        return scale * stored[:, 4:].view(ml_dtypes.float8_e4m3fn).astype(np.float64)

    def quantize(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float32)
        if not self.fits(values.shape):
            raise ValueError(f"{self.name} stores {self.stores}, not shape {list(values.shape)}")
        scale = np.broadcast_to(fp8_scale(values, "e4m3", self.per_row), (len(values), 1)).astype("<f4")
        q = fp8_quantized(values, "e4m3", scale)
        return np.concatenate([scale.view(np.uint8), q.view(np.uint8)], axis=1)


class UnknownWeightFormat(ValueError):
    """A weight format name the suite does not know: the message lists the known ones."""


def weight_format(name: str) -> WeightFormat:
    """The format called ``name``; an unknown name raises UnknownWeightFormat naming it and the known ones."""
    try:
        return WEIGHT_FORMATS[name]
    except (KeyError, TypeError):
        raise UnknownWeightFormat(f"unknown weight format {name!r}; the known formats are "
                                  f"{', '.join(WEIGHT_FORMATS)}") from None


# ---- helpers ---------------------------------------------------------------------------------------

def _fp16(raw: np.ndarray) -> np.ndarray:
    """Two little-endian bytes per row as the fp16 value they hold, in float64 (exactly): ``[n]``."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float64)[:, 0]


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype("<f2").view(np.uint8).reshape(-1, 2)


def _round_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero (numpy's round goes to even). Computed without adding 0.5,
    which rounds in float32 (0.49999997 + 0.5 is 1): ``|x| - floor(|x|)`` is exact."""
    a = np.abs(x)
    whole = np.floor(a)
    return np.sign(x) * (whole + (a - whole >= 0.5))


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d))


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes ``[n, k]`` as ``[n, 2k]`` 4-bit values: every low nibble, then every high one (GGML's order)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    half = q.shape[-1] // 2
    return (q[..., :half] | (q[..., half:] << 4)).astype(np.uint8)


# ---- q8_0: fp16 d, 32 int8 q; x = d * q ------------------------------------------------------------

def _q8_0_dequantize(blocks: np.ndarray) -> np.ndarray:
    return _fp16(blocks[:, :2])[:, None] * blocks[:, 2:].view(np.int8)


def _q8_0_quantize(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    q = _round_away(x * _inverse(d)).astype(np.int8)
    return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=1)


# ---- q4_0: fp16 d, 16 bytes of 4-bit q; x = d * (q - 8) ----------------------------------------------

def _q4_0_dequantize(blocks: np.ndarray) -> np.ndarray:
    return _fp16(blocks[:, :2])[:, None] * (_nibbles(blocks[:, 2:]).astype(np.int64) - 8)


def _q4_0_quantize(x: np.ndarray) -> np.ndarray:
    # The signed value of largest magnitude maps to -8 (llama.cpp: d = max / -8).
    extreme = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    d = extreme / np.float32(-8)
    q = np.clip(np.trunc(x * _inverse(d) + np.float32(8.5)), 0, 15).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q)], axis=1)


# ---- q4_k: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
#      4-bit q; x = d * sc_j * q - dmin * m_j --------------------------------------------------------

def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``get_scale_min_k4``: the 8 six-bit scales and mins of each block from its 12 bytes."""
    p = packed.astype(np.int64)
    low, mid, high = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    sc = np.concatenate([low & 63, (high & 0x0F) | ((low >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, m


def _q4_k_dequantize(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    sc, m = _q4_k_scales(blocks[:, 4:16])
    # 4 runs of 32 bytes, each the low nibbles of sub-block 2j and the high nibbles of sub-block 2j+1
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32)
    return ((d[:, None] * sc)[..., None] * q - (dmin[:, None] * m)[..., None]).reshape(n, QK_K)


def _q4_k_quantize(x: np.ndarray) -> np.ndarray:
    n = len(x)
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)                  # the stored min m_j is -low >= 0
    step = (sub.max(axis=2) - low) / np.float32(15)
    d = step.max(axis=1) / np.float32(63)
    dmin = (-low).max(axis=1) / np.float32(63)
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(_round_away(step * _inverse(d16)[:, None]), 0, 63).astype(np.int64)
    m = np.clip(_round_away(-low * _inverse(dmin16)[:, None]), 0, 63).astype(np.int64)
    scale, offset = d16[:, None] * sc, dmin16[:, None] * m
    q = np.clip(_round_away((sub + offset[..., None]) * _inverse(scale)[..., None]), 0, 15).astype(np.int64)
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1).astype(np.uint8)
    qs = _pack_nibbles(q.reshape(n, 4, 64)).reshape(n, 128)
    return np.concatenate([_fp16_bytes(d16), _fp16_bytes(dmin16), packed, qs], axis=1)


# ---- q6_k: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales (one per 16 values), fp16
#      d; x = d * sc_j * (q - 32) ----------------------------------------------------------------------

def _q6_k_dequantize(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    ql = blocks[:, :128].reshape(n, 2, 2, 32).astype(np.int64)   # half, run, l
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32).astype(np.int64)
    sc = blocks[:, 192:208].view(np.int8).astype(np.int64)
    d = _fp16(blocks[:, 208:210])
    # in each half of 128 values: l, l+32, l+64, l+96 from ql[l], ql[l+32] (low, then high nibbles)
    # and the 2-bit pairs 0, 1, 2, 3 of qh[l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)           # [n, 2, 4, 32]
    high = (qh >> (2 * np.arange(4)[:, None])) & 3
    q = (low | (high << 4)) - 32
    return ((d[:, None] * sc)[..., None] * q.reshape(n, 16, 16)).reshape(n, QK_K)


def _q6_k_quantize(x: np.ndarray) -> np.ndarray:
    n = len(x)
    sub = x.reshape(n, 16, 16)
    extreme = np.take_along_axis(sub, np.abs(sub).argmax(axis=2)[..., None], axis=2)[..., 0]
    step = extreme / np.float32(-32)                       # the extreme value maps to q - 32 = -32
    big = np.take_along_axis(step, np.abs(step).argmax(axis=1)[:, None], axis=1)[:, 0]
    d16 = (big / np.float32(-128)).astype(np.float16).astype(np.float32)
    sc = np.clip(_round_away(step * _inverse(d16)[:, None]), -128, 127).astype(np.int64)
    scale = d16[:, None] * sc
    q = (np.clip(_round_away(sub * _inverse(scale)[..., None]), -32, 31).astype(np.int64) + 32).reshape(n, 2, 4, 32)
    ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)
    qh = sum((q[:, :, k] >> 4) << (2 * k) for k in range(4))
    return np.concatenate([ql.reshape(n, 128).astype(np.uint8), qh.reshape(n, 64).astype(np.uint8),
                           sc.astype(np.int8).view(np.uint8), _fp16_bytes(d16)], axis=1)


# ---- int4 with group scales (AWQ, GPTQ): per group of G values, fp16 s, 4-bit zero z, 4-bit q; x = s * (q - z)

def _int4_dequantize(G: int, blocks: np.ndarray) -> np.ndarray:
    q = np.stack([blocks[:, 3:] & 0x0F, blocks[:, 3:] >> 4], axis=-1).reshape(len(blocks), G)
    return _fp16(blocks[:, :2])[:, None] * (q.astype(np.int64) - (blocks[:, 2:3] & 0x0F))


def _int4_quantize(x: np.ndarray) -> np.ndarray:
    # AWQ: s = (max - min) / 15 (at least 1e-5), z = round(-min / s) and q = round(x / s) + z, both clamped
    # to 0..15 (halves to even, as torch.round); here from s once stored in fp16, so that the values are
    # those the stored s gives.
    low, high = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    s = np.maximum((high - low) / np.float32(15), np.float32(1e-5)).astype(np.float16).astype(np.float32)
    z = np.clip(np.rint(-low / s), 0, 15)
    q = np.clip(np.rint(x / s) + z, 0, 15).astype(np.uint8)
    return np.concatenate([_fp16_bytes(s), z.astype(np.uint8), q[:, 0::2] | (q[:, 1::2] << 4)], axis=1)


def _int4_group(G: int) -> WeightFormat:
    """AWQ's and GPTQ's asymmetric int4 with groups of ``G`` consecutive input features of a row (their
    checkpoints hold an fp16 scale per group and the zero points packed as 4-bit integers, ``qzeros``), in
    the suite's own layout of 3 + G / 2 bytes per group: the fp16 scale s (2 bytes, little-endian), the zero
    point z (1 byte: the low nibble, the high one written 0 and not read), then the G values' 4-bit q two to
    a byte, value 2j in the low nibble of byte j and 2j + 1 in its high one (GPTQ's order: its ``qweight``
    packs 8 consecutive values in an int32 from the low bits up).  x = s * (q - z)."""
    return WeightFormat(f"int4_g{G}", G, 3 + G // 2, None, partial(_int4_dequantize, G), _int4_quantize)


WEIGHT_FORMATS: dict[str, WeightFormat | ScaledFp8] = {f.name: f for f in (
    WeightFormat("q8_0", 32, 34, "Q8_0", _q8_0_dequantize, _q8_0_quantize),
    WeightFormat("q4_0", 32, 18, "Q4_0", _q4_0_dequantize, _q4_0_quantize),
    WeightFormat("q4_k", QK_K, 144, "Q4_K", _q4_k_dequantize, _q4_k_quantize),
    WeightFormat("q6_k", QK_K, 210, "Q6_K", _q6_k_dequantize, _q6_k_quantize),
    ScaledFp8("fp8_e4m3_channel", per_row=True),
    ScaledFp8("fp8_e4m3_tensor", per_row=False),
    _int4_group(128),  # AWQ's and GPTQ's default group size
    _int4_group(32),   # fits every matrix of the small geometry (hidden size 64)
)}
# fp8 weight formats -> (fp8 kind, whether each row, an output channel, has its own scale)
FP8_WEIGHTS = {name: ("e4m3", fmt.per_row) for name, fmt in WEIGHT_FORMATS.items() if isinstance(fmt, ScaledFp8)}


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight matrix held in a weight format, as an adapter that declares that format receives it in the op
    tests (docs/adapter.md): ``stored`` is its blocks (uint8 ``[rows, row bytes]``, the layout a checkpoint
    stores) and ``shape`` the matrix's ``[rows, columns]``.  Its ``values`` are the spec's W, exactly."""

    format: str
    stored: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def of(cls, name: str, values: np.ndarray) -> "QuantizedWeight":
        """``values`` (``[rows, columns]``) rounded to the format ``name``."""
        return cls(name, weight_format(name).quantize(values), tuple(np.shape(values)))

    def values(self) -> np.ndarray:
        """The exact values (float64 ``[rows, columns]``) the blocks hold."""
        return weight_format(self.format).dequantize(self.stored)



# ---- activations: x rounded to blocks before a product, as llama.cpp's CPU path does ---------------

def _q8_0_round(rows: np.ndarray) -> np.ndarray:
    """ggml-cpu's ``quantize_row_q8_0`` (its AVX2 path, which llama.cpp runs here): d = amax / 127 stored in
    fp16, q = the nearest integer to x (127 / amax) in float32, halves to even."""
    amax = np.abs(rows).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    with np.errstate(over="ignore"):  # a scale past fp16's range is inf, as llama.cpp stores it
        d = (amax / np.float32(127)).astype(np.float16).astype(np.float64)
    return d * np.rint(rows * inverse)


def _q8_k_round(rows: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_K``: the block's value of largest magnitude m, iscale = -127 / m and d = 1 / iscale
    in float32, q = the nearest integer to iscale x (halves to even), at most 127."""
    m = rows[np.arange(len(rows)), np.argmax(np.abs(rows), axis=1)][:, None]
    with np.errstate(divide="ignore"):
        iscale = np.where(m == 0, np.float32(0), np.float32(-127) / m).astype(np.float32)
        d = np.where(m == 0, np.float32(0), np.float32(1) / iscale).astype(np.float64)
    return d * np.minimum(np.rint(iscale * rows), 127)


# Per activation format: values per block, and the rounding of float32 blocks [n, block] (exact values, float64).
ACTIVATION_ROUNDINGS: dict[str, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    "q8_0": (32, _q8_0_round), "q8_k": (QK_K, _q8_k_round)}


def rounded_activations(x: np.ndarray, name: str) -> np.ndarray:
    """x rounded to the activation format ``name`` along its last axis: to blocks (a last, partial block
    padded with zeros), from x in float32, as llama.cpp's CPU path rounds it before a product with quantized
    weights (tests/test_llama_cpp.py holds it against the engine), or to fp8 with a dynamic scale per row
    (a token) or per tensor (``FP8_ACTIVATIONS``, ``rounded_to_fp8``): the exact values (float64), a scale
    times an integer or an fp8 value each.  The rounding a declared activation format stands for
    (docs/quantized.md)."""
    x = np.asarray(x)
    K = x.shape[-1]
    if name in FP8_ACTIVATIONS:
        return rounded_to_fp8(x.reshape(-1, K), *FP8_ACTIVATIONS[name]).reshape(x.shape)
    block, rounding = ACTIVATION_ROUNDINGS[name]
    rows = np.zeros((int(np.prod(x.shape[:-1], dtype=np.int64)), -(-K // block) * block), dtype=np.float32)
    rows[:, :K] = x.reshape(-1, K)
    return rounding(rows.reshape(-1, block)).reshape(len(rows), -1)[:, :K].reshape(x.shape)


# ---- the KV cache in fp8: fp8(x / s) stored, fp8 * s read back (vLLM's kv_cache_dtype="fp8_e4m3") ----

def stored_in_fp8(x: np.ndarray, name: str, scale: float) -> np.ndarray:
    """fp8(x / scale) as a KV cache in ``name`` (``fp8_e4m3``, ``fp8_e5m2``) stores it: x in float32 times the
    float32 inverse of the scale, rounded to the nearest fp8 value (e4m3fn's NaN and e5m2's inf past their
    range)."""
    with np.errstate(over="ignore"):
        return (np.asarray(x, dtype=np.float32) * (np.float32(1) / np.float32(scale))).astype(
            FP8_TYPES[name.removeprefix("fp8_")])


def read_from_fp8(stored: np.ndarray, scale: float, dtype) -> np.ndarray:
    """The cache's values read back: fp8 times the float32 scale, in the dtype the attention computes in."""
    return (stored.astype(np.float32) * np.float32(scale)).astype(dtype)
