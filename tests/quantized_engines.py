"""Engines that round beyond the dtype under test, as quantized engines do: the numpy reference with its
products (linear, gate_up, lm_head) computed on x rounded to ``q8_0`` blocks, as llama.cpp's CPU path
rounds its activations.  ``DECLARED`` says so in its ``formats``; ``UNDECLARED`` is the same engine
without the declaration, which the suite must fail.  Load one with
--backend=tests.quantized_engines:DECLARED (or :UNDECLARED).  Likewise ``KV_DECLARED`` and
``KV_UNDECLARED``: its attention ops on k and v stored in an fp8 e4m3 KV cache with scales, as vLLM's fp8
KV cache stores them (``KV_E5M2`` in e5m2).

``FP8_DECLARED`` and ``FP8_UNDECLARED`` are the numpy reference with its products computed as
torch._scaled_mm and vLLM's fp8 linear compute them: x rounded to float8_e4m3fn per token and W per output
channel, each with its dynamic float32 scale, the products exact and scaled after; ``FP8_STATIC`` takes
x's scale from a fixed calibration instead of x, so values past it saturate at 448 (a rounding no
declared format bounds).

``Q4_K_WEIGHTS`` holds its products' weights in q4_k and rounds x to q8_k blocks, as llama.cpp's CPU path
does, and ``Q8_0_WEIGHTS`` holds them in q8_0 and rounds nothing else, each declaring it: the op tests
hand them W as a ``QuantizedWeight``.  ``Q8_0_WEIGHTS_UNDECLARED`` rounds the W it is handed to q8_0 itself and declares
nothing.

Also the mistakes an engine's dequantization can make, as edits of a block's bytes that the right
dequantization then reads wrongly (tests/test_quantized.py, the forward mutants that read a quantized
checkpoint's blocks themselves: tests/forward_mutants.py, and ``Q4_K_MIN_WRONG_SIGN`` and
``Q8_0_SCALES_IN_BFLOAT16``, which read the op tests' blocks so).
"""

from __future__ import annotations


import ml_dtypes
import numpy as np

from gemma4_conformance.adapters.numpy_backend import RoundsAsDeclared
from gemma4_conformance.checkpoints.quantized import (FP8_ACTIVATIONS, FP8_WEIGHTS, WEIGHT_FORMATS, QuantizedWeight,
                                                     fp8_quantized, read_from_fp8)

# byte offsets of each format's fp16 scales in a block (d, and dmin in q4_k)
SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}


DECLARED = RoundsAsDeclared({"activations": "q8_0"}, "numpy-q8_0-activations", declare=True)
UNDECLARED = RoundsAsDeclared({"activations": "q8_0"}, "numpy-q8_0-activations-undeclared")

ATTENTION = RoundsAsDeclared.ATTENTION


class KvCacheInFp8(RoundsAsDeclared):
    """The numpy reference, its attention ops on k and v stored in an fp8 KV cache with per-tensor scales
    (``kv_cache``: a declared KV cache format, adapters.kv_cache_format) and read back, as vLLM's
    ``kv_cache_dtype="fp8_e4m3"`` does; ``formats`` only where ``declare``.  ``read``: how the cache is
    read back (``read_from_fp8``; the mutation study's mutant drops the scale)."""

    def __init__(self, name: str, kv_cache: str, declare: bool, read=read_from_fp8):
        super().__init__({"kv_cache": kv_cache}, name, declare)
        self.read_cache = read


# Scales that are not powers of two (a power of two's quotient is exact), and that the suite's attention
# cases fit under (their k and v stay below 448 x 1.5 = 672).
KV_DECLARED = KvCacheInFp8("numpy-kv-fp8_e4m3", "fp8_e4m3@1.5:0.75", declare=True)
KV_UNDECLARED = KvCacheInFp8("numpy-kv-fp8_e4m3-undeclared", "fp8_e4m3@1.5:0.75", declare=False)
KV_E5M2 = KvCacheInFp8("numpy-kv-fp8_e5m2", "fp8_e5m2@1.5:0.75", declare=True)


class Fp8Products(RoundsAsDeclared):
    """The numpy reference, its products on x and W rounded to fp8 with dynamic scales (``activations``,
    ``weights``: (kind, per row) or None; ``RoundsAsDeclared``), declaring ``formats`` (None: nothing), x
    rounded by ``rounds_x`` instead where given (a mutant's rounding)."""

    def __init__(self, name: str, formats: dict[str, str] | None, activations=("e4m3", True),
                 weights=("e4m3", True), rounds_x=None):
        does = {}
        if activations:
            does["activations"] = {how: fmt for fmt, how in FP8_ACTIVATIONS.items()}[activations]
        if weights:
            does["weights"] = {how: fmt for fmt, how in FP8_WEIGHTS.items()}[weights]
        super().__init__(does, name)
        if formats is not None:
            self.formats = formats
        if rounds_x is not None:
            self.round_x = rounds_x


def static_scale_saturating(x: np.ndarray) -> np.ndarray:
    """x rounded to e4m3 with a scale calibrated once for |x| <= 1 (s = 1 / 448), not taken from x: every
    value past 1 saturates at 448 s = 1."""
    scale = np.float32(1) / np.float32(448)
    return fp8_quantized(x, "e4m3", scale).astype(np.float64) * np.float64(scale)


FP8_FORMATS = {"activations": "fp8_e4m3_token", "weights": "fp8_e4m3_channel"}
FP8_DECLARED = Fp8Products("numpy-fp8-e4m3", FP8_FORMATS)
FP8_UNDECLARED = Fp8Products("numpy-fp8-e4m3-undeclared", None)
FP8_STATIC = Fp8Products("numpy-fp8-e4m3-static-scale", FP8_FORMATS, rounds_x=static_scale_saturating)


def set_scale(blocks: np.ndarray, at: int, bits: np.ndarray) -> None:
    blocks[:, at:at + 2] = np.asarray(bits, dtype="<u2").reshape(-1, 1).view(np.uint8).reshape(-1, 2)


def min_with_wrong_sign(name: str, blocks: np.ndarray) -> np.ndarray:
    """``q4_k`` blocks with dmin's sign flipped: dequantized, each sub-block's min is added, not subtracted."""
    assert name == "q4_k", "only q4_k's blocks have a min"
    out = blocks.copy()
    out[:, 3] ^= 0x80
    return out


def scales_in_bfloat16(name: str, blocks: np.ndarray) -> np.ndarray:
    """Blocks with every fp16 scale rounded to bfloat16 (8 significant bits) and back, as a dequantization
    that reads the scales into bfloat16 does."""
    out = blocks.copy()
    for at in SCALES[name]:
        scale = out[:, at:at + 2].copy().view("<f2").astype(np.float32)
        with np.errstate(over="ignore"):  # a scale near 65504 rounds to bfloat16's 65536: inf
            set_scale(out, at, scale.astype(ml_dtypes.bfloat16).astype(np.float32).astype("<f2").view("<u2"))
    return out


def fp8_scales_in_bfloat16(name: str, rows: np.ndarray) -> np.ndarray:
    """fp8 rows (tests' view of checkpoints.quantized.ScaledFp8: a float32 scale, then e4m3fn bytes) with the
    scale rounded to bfloat16, as a loader that reads the scales into the model's dtype does."""
    assert name.startswith("fp8_"), "only the fp8 rows have a float32 scale first"
    out = rows.copy()
    scale = out[:, :4].copy().view("<f4")
    out[:, :4] = scale.astype(ml_dtypes.bfloat16).astype("<f4").view(np.uint8)
    return out


def int4_zero_point_ignored(name: str, blocks: np.ndarray) -> np.ndarray:
    """int4 groups (tests' view of checkpoints.quantized's int4 layout: fp16 scale, zero point byte, values)
    with the zero point 0: dequantized, s * q, as a reader that takes asymmetric int4 (AWQ's
    ``zero_point=True``, GPTQ's ``sym=False``) for unsigned values without an offset does."""
    assert name.startswith("int4_"), "only the int4 groups have a zero point"
    out = blocks.copy()
    out[:, 2] = 0
    return out


def read_wrongly(mistake, name: str, stored: np.ndarray) -> np.ndarray:
    """The values a dequantization that makes ``mistake`` reads from a ``name`` matrix's ``stored`` bytes."""
    fmt = WEIGHT_FORMATS[name]
    units = stored if fmt.whole_tensors else stored.reshape(-1, fmt.block_bytes)  # fp8's rows, or the blocks
    with np.errstate(over="ignore", invalid="ignore"):
        return fmt.dequantize(mistake(name, units).reshape(stored.shape))


class BlockWeights(RoundsAsDeclared):
    """The numpy reference, its products on weights held in the block format ``weights`` and on x rounded
    to ``activations``, both declared where ``declare``.  Declared, the op tests hand it W in the format
    (``QuantizedWeight``), which it reads as its exact values, or with ``mistake``; undeclared, it is handed W
    in the dtype and rounds it to the format itself."""

    def __init__(self, name: str, weights: str, activations: str | None, declare: bool = True, mistake=None):
        rounds = {"activations": activations} if activations else {}
        super().__init__(rounds, name)
        if declare:
            self.formats = {"weights": weights, **rounds}
        self.weights, self.mistake = weights, mistake

    def dequantize(self, weight: QuantizedWeight) -> np.ndarray:
        return weight.values() if self.mistake is None else read_wrongly(self.mistake, weight.format, weight.stored)

    def _product(self, op):
        run = super()._product(op)

        def held(*args):
            *head, x = args
            return run(*(QuantizedWeight.of(self.weights, a) if isinstance(a, np.ndarray) and a.ndim == 2 else a
                         for a in head), x)

        return held


Q4_K_WEIGHTS = BlockWeights("numpy-q4_k-weights", "q4_k", "q8_k")
Q8_0_WEIGHTS = BlockWeights("numpy-q8_0-weights", "q8_0", None)
Q8_0_WEIGHTS_UNDECLARED = BlockWeights("numpy-q8_0-weights-undeclared", "q8_0", None, declare=False)


def dequantized_wrongly(mistake, weights):
    """The checkpoint's tensors, each quantized matrix read from its blocks with ``mistake``; a checkpoint
    without quantized matrices is refused (the mutant would be the reference)."""
    formats = weights.weight_formats
    if not formats:
        raise ValueError("this engine reads a quantized checkpoint's blocks: give --weights a quantized one")
    out = {name: weights[name] for name in weights}
    for name, format_name in formats.items():
        info = weights.info(name)
        stored = np.fromfile(info.file, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(
            WEIGHT_FORMATS[format_name].stored_shape(info.shape))
        out[name] = read_wrongly(mistake, format_name, stored)
    return out


Q4_K_MIN_WRONG_SIGN = BlockWeights("numpy-q4_k-weights-min-wrong-sign", "q4_k", "q8_k", mistake=min_with_wrong_sign)
Q8_0_SCALES_IN_BFLOAT16 = BlockWeights("numpy-q8_0-weights-scales-in-bfloat16", "q8_0", None,
                                       mistake=scales_in_bfloat16)
