"""checkpoints.quantized: the GGUF block formats dequantized exactly, bit for bit against the ``gguf``
package's own dequantization (the independent reference: llama.cpp's Python package, whose code this
suite does not share); the quantizers; mutants of the dequantization caught by the same check."""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_conformance.checkpoints.quantized import WEIGHT_FORMATS, UnknownWeightFormat, weight_format

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402  (after the skip: the test extra installs it)

#: byte offsets of each format's fp16 scales in a block (d, and dmin in q4_k)
SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}
#: fp16 bit patterns at the edges: zeros, the smallest and largest subnormals, the smallest normal, one, the
#: largest finite value, and their negatives
EDGE_SCALES = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF, 0x83FF],
                       dtype="<u2")


def ggml_type(fmt):
    return getattr(gguf.GGMLQuantizationType, fmt.ggml_type)


def set_scale(blocks: np.ndarray, at: int, bits: np.ndarray) -> None:
    blocks[:, at:at + 2] = np.asarray(bits, dtype="<u2").reshape(-1, 1).view(np.uint8).reshape(-1, 2)


def random_blocks(fmt, n: int, seed: int) -> np.ndarray:
    """Random bytes with finite fp16 scales of every magnitude (uniform over the bit patterns: a tenth are
    subnormal), then blocks at the edges: every edge scale, and q4_k blocks whose sub-blocks are all min
    (scale 0, the largest min) or hold the largest scale and min at once."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, fmt.block_bytes), dtype=np.uint8)
    for at in SCALES[fmt.name]:
        set_scale(blocks, at, rng.integers(0, 0x7C00, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15))
    edges = np.repeat(blocks[:len(EDGE_SCALES)], len(SCALES[fmt.name]), axis=0).copy()
    for k, at in enumerate(SCALES[fmt.name]):
        set_scale(edges, at, np.roll(EDGE_SCALES, k)[np.arange(len(edges)) % len(EDGE_SCALES)])
    if fmt.name == "q4_k":
        all_min = blocks[:2].copy()
        all_min[0, 4:16] = [0, 0, 0, 0, 63, 63, 63, 63, 0xF0, 0xF0, 0xF0, 0xF0]   # sc 0, m 63 in all 8
        all_min[1, 4:16] = 0xFF                                                     # sc 63, m 63 in all 8
        set_scale(all_min, 2, [0x7BFF, 0x7BFF])
        edges = np.concatenate([edges, all_min])
    return np.concatenate([blocks, edges])


def mismatches(fmt, blocks: np.ndarray, dequantize=None) -> int:
    """How many values of ``blocks`` ``dequantize`` (the format's own by default) gets wrong, bit for bit
    against gguf. gguf computes in float32: the exact values of q8_0, q4_0 and q6_k fit in it, so theirs
    are those values; a q4_k value may not, and theirs is its rounding to float32 (see the module). So
    float32 bits must match, and for the formats that fit, the float64 values too."""
    ours = (dequantize or fmt.dequantize_blocks)(blocks).reshape(len(blocks), -1)
    theirs = quants.dequantize(blocks, ggml_type(fmt)).reshape(ours.shape)
    wrong = ours.astype(np.float32).view(np.uint32) != theirs.view(np.uint32)
    if fmt.name != "q4_k":
        wrong |= ours != theirs.astype(np.float64)
    return int(wrong.sum())


@pytest.mark.parametrize("name", list(WEIGHT_FORMATS))
def test_dequantization_is_bit_exact_against_gguf(name):
    fmt = WEIGHT_FORMATS[name]
    blocks = random_blocks(fmt, 4096, seed=len(name) + fmt.block_bytes)
    assert mismatches(fmt, blocks) == 0
    rows = blocks[:4096].reshape(64, -1)  # rows of several blocks: the blocks run along a row
    values = fmt.dequantize(rows)
    assert values.shape == (64, 64 * fmt.block) and values.dtype == np.float64 and np.isfinite(values).all()
    np.testing.assert_array_equal(values.reshape(-1, fmt.block), fmt.dequantize_blocks(blocks[:4096]))


def test_q4_k_values_are_exact_where_float32_rounds():
    """q4_k's values are d * sc * q - dmin * m exactly: in units of 2^-24 (the last bit of the smallest fp16
    subnormal) each is an integer below 2^51, computed here in int64 from gguf's own unpacking of the
    6-bit scales and mins; float32 (gguf's result) rounds some of them."""
    fmt = WEIGHT_FORMATS["q4_k"]
    blocks = random_blocks(fmt, 2048, seed=7)
    n = len(blocks)
    units = 2.0 ** 24
    d = (blocks[:, 0:2].copy().view("<f2").astype(np.float64)[:, 0] * units).astype(np.int64)
    dmin = (blocks[:, 2:4].copy().view("<f2").astype(np.float64)[:, 0] * units).astype(np.int64)
    sc, m = (a.astype(np.int64) for a in quants.Q4_K.get_scale_min(blocks[:, 4:16].copy()))
    runs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (runs & 0x0F).reshape(n, 8, 32).astype(np.int64)
    exact = (d[:, None, None] * sc[..., None] * q - (dmin[:, None] * m)[..., None]).reshape(n, -1)
    assert np.abs(exact).max() < 2 ** 51
    ours = fmt.dequantize_blocks(blocks)
    np.testing.assert_array_equal(ours * units, exact.astype(np.float64))
    rounded = quants.dequantize(blocks, ggml_type(fmt)).reshape(ours.shape).astype(np.float64)
    assert (rounded != ours).sum() > 100, "the draw reaches values float32 cannot hold"


def _negated_min(blocks):
    """A mutant's input: dmin's sign flipped, so that the true dequantization adds the sub-blocks' mins."""
    out = blocks.copy()
    out[:, 3] ^= 0x80
    return out


def _scales_in_bfloat16(fmt):
    """A mutant's input: every fp16 scale rounded to bfloat16 (8 significant bits) and back."""
    import ml_dtypes

    def transform(blocks):
        out = blocks.copy()
        for at in SCALES[fmt.name]:
            scale = out[:, at:at + 2].copy().view("<f2").astype(np.float32)
            set_scale(out, at, scale.astype(ml_dtypes.bfloat16).astype(np.float32).astype("<f2").view("<u2"))
        return out
    return transform


@pytest.mark.parametrize("mutant", ["q4_k min with the wrong sign", "q4_k scales rounded to bfloat16",
                                    "q8_0 scale rounded to bfloat16", "q6_k scale rounded to bfloat16"])
def test_a_wrong_dequantization_is_caught(mutant):
    fmt = WEIGHT_FORMATS[mutant[:4]]
    transform = _negated_min if "wrong sign" in mutant else _scales_in_bfloat16(fmt)
    blocks = random_blocks(fmt, 512, seed=3)
    assert mismatches(fmt, blocks) == 0
    with np.errstate(over="ignore", invalid="ignore"):  # a scale near 65504 rounds to bfloat16's 65536: inf
        assert mismatches(fmt, blocks, lambda b: fmt.dequantize_blocks(transform(b))) > len(blocks)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_the_reference_quantizers_write_gguf_s_bytes(name):
    """q8_0 and q4_0 follow llama.cpp's reference quantizers, as gguf's do (rounding halves away from
    zero; the draw includes exact halves)."""
    fmt = WEIGHT_FORMATS[name]
    rng = np.random.default_rng(11)
    x = rng.standard_normal((32, 256)).astype(np.float32)
    x[0] = np.arange(256) / 2 - 64          # q8_0's halves: max 63.5 -> d 0.5
    x[1] = 0                                 # a zero block
    np.testing.assert_array_equal(fmt.quantize(x), quants.quantize(x, ggml_type(fmt)))


@pytest.mark.parametrize("name, worst", [("q8_0", 0.01), ("q4_0", 0.12), ("q4_k", 0.1), ("q6_k", 0.03)])
def test_quantizing_then_dequantizing_keeps_the_values_close(name, worst):
    """The own quantizers are not gguf's (it has none for the k-quants) but must be sane: the relative RMS
    error of a normal draw is that of a format of 8, 4, ~4.5 and ~6.5 bits (measured: 0.54%, 8.6%, 7.8%,
    1.9%), and a block of zeros stays zero."""
    fmt = WEIGHT_FORMATS[name]
    x = np.random.default_rng(5).standard_normal((64, 1024)).astype(np.float32)
    x[0] = 0
    y = fmt.dequantize(fmt.quantize(x))
    assert np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean()) < worst
    assert not y[0].any()
    assert mismatches(fmt, fmt.quantize(x).reshape(-1, fmt.block_bytes)) == 0


def test_an_unknown_format_names_the_known_ones():
    with pytest.raises(UnknownWeightFormat, match=r"unknown weight format 'q3_k'; the known formats are "
                                                  r"q8_0, q4_0, q4_k, q6_k"):
        weight_format("q3_k")
    assert weight_format("q4_k") is WEIGHT_FORMATS["q4_k"]
    with pytest.raises(ValueError, match="multiples of 256 values, not shape \\[4, 64\\]"):
        WEIGHT_FORMATS["q4_k"].quantize(np.zeros((4, 64)))
