"""checkpoints.quantized: the GGUF block formats dequantized exactly, bit for bit against the ``gguf``
package's own dequantization (the independent reference: llama.cpp's Python package, whose code this
suite does not share); the quantizers; mutants of the dequantization caught by the same check."""

from __future__ import annotations

import ctypes
import json
import math
import shutil
import struct
from fractions import Fraction
from functools import partial
from pathlib import Path

import gguf  # the test extra installs it: without it the bit-exactness check must fail, not skip
import ml_dtypes
import numpy as np
import pytest
from gguf import quants

from gemma4_conformance.checkpoints import generate
from gemma4_conformance.checkpoints.checkpoint import FORMATS_KEY, CheckpointError, load
from gemma4_conformance.checkpoints.quantized import WEIGHT_FORMATS, ScaledFp8, UnknownWeightFormat, weight_format
from gemma4_conformance.properties.forward import reference
from tests.quantized_engines import SCALES, int4_zero_point_ignored, min_with_wrong_sign, scales_in_bfloat16, set_scale

#: fp16 bit patterns at the edges: zeros, the smallest and largest subnormals, the smallest normal, one, the
#: largest finite value, and their negatives
EDGE_SCALES = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF, 0x83FF],
                       dtype="<u2")


GGUF_FORMATS = [name for name, fmt in WEIGHT_FORMATS.items() if fmt.ggml_type]
FP8_FORMATS = [name for name, fmt in WEIGHT_FORMATS.items() if isinstance(fmt, ScaledFp8)]
INT4_FORMATS = ["int4_g128", "int4_g32"]


def ggml_type(fmt):
    return getattr(gguf.GGMLQuantizationType, fmt.ggml_type)


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


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_dequantization_is_bit_exact_against_gguf(name):
    fmt = WEIGHT_FORMATS[name]
    blocks = random_blocks(fmt, 4096, seed=len(name) + fmt.block_bytes)
    assert mismatches(fmt, blocks) == 0
    rows = blocks[:4096].reshape(64, -1)  # rows of several blocks: the blocks run along a row
    values = fmt.dequantize(rows)
    assert values.shape == (64, 64 * fmt.block) and values.dtype == np.float64 and np.isfinite(values).all()
    np.testing.assert_array_equal(values.reshape(-1, fmt.block), fmt.dequantize_blocks(blocks[:4096]))


def ggml_dequantizer(fmt):
    """llama.cpp's own ``dequantize_row_<type>`` (ggml-quants.c, float32 out) from the ggml library that
    llama-cpp-python ships; skips where it is not installed."""
    llama_cpp = pytest.importorskip("llama_cpp")
    library = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    function = getattr(library, f"dequantize_row_{fmt.ggml_type.lower().replace('_k', '_K')}")
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None

    def dequantize(blocks):
        blocks = np.ascontiguousarray(blocks)
        out = np.empty((len(blocks), fmt.block), dtype=np.float32)
        function(blocks.ctypes.data, out.ctypes.data, out.size)
        return out

    return dequantize


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_dequantization_is_bit_exact_against_llama_cpp(name):
    """The same blocks through llama.cpp's own dequantization (its float32 values: ours rounded to float32
    bit for bit, and for the formats whose values float32 holds, ours exactly)."""
    fmt = WEIGHT_FORMATS[name]
    blocks = random_blocks(fmt, 4096, seed=len(name) + fmt.block_bytes)
    ours, theirs = fmt.dequantize_blocks(blocks), ggml_dequantizer(fmt)(blocks)
    wrong = ours.astype(np.float32).view(np.uint32) != theirs.view(np.uint32)
    if name != "q4_k":
        wrong |= ours != theirs.astype(np.float64)
    assert int(wrong.sum()) == 0
    with np.errstate(invalid="ignore"):  # a scale rounded up to bfloat16's inf times a zero
        misread = fmt.dequantize_blocks(scales_in_bfloat16(name, blocks))  # the check can fail
    assert (misread.astype(np.float32).view(np.uint32) != theirs.view(np.uint32)).any()


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


@pytest.mark.parametrize("mutant", ["q4_k min with the wrong sign", "q4_k scales rounded to bfloat16",
                                    "q8_0 scale rounded to bfloat16", "q6_k scale rounded to bfloat16"])
def test_a_wrong_dequantization_is_caught(mutant):
    fmt = WEIGHT_FORMATS[mutant[:4]]
    transform = partial(min_with_wrong_sign if "wrong sign" in mutant else scales_in_bfloat16, fmt.name)
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


# ---- fp8: e4m3fn values and float32 scales ------------------------------------------------------------

def e4m3fn_value(byte: int) -> float:
    """An e4m3fn byte's value from its fields (sign, 4 exponent bits biased by 7, 3 mantissa bits; the
    exponent 0 subnormal; 0x7f and 0xff NaN, no inf): apart from ml_dtypes, which the format reads with."""
    sign, exponent, mantissa = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    magnitude = math.ldexp(mantissa, -9) if exponent == 0 else math.ldexp(8 + mantissa, exponent - 10)
    return -magnitude if sign else magnitude


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_fp8_dequantization_is_exact_against_the_fields_of_every_byte(name):
    """Every e4m3fn byte in every row, scales of every float32 magnitude (subnormal, 1, the largest, random
    bit patterns): the value is scale times the byte's value, exactly (float64 holds it: 24 + 4 bits)."""
    fmt = WEIGHT_FORMATS[name]
    rng = np.random.default_rng(7)
    scales = np.concatenate([np.array([2.0**-149, 2.0**-126, 1.0, np.finfo(np.float32).max], dtype="<f4"),
                             rng.integers(0, 0x7F800000, 60, dtype=np.uint32).view("<f4")])
    stored = np.concatenate([scales.reshape(-1, 1).view(np.uint8),
                             np.tile(np.arange(256, dtype=np.uint8), (len(scales), 1))], axis=1)
    ours = fmt.dequantize(stored)
    expected = np.array([[float(Fraction(float(s)) * Fraction(e4m3fn_value(b))) if b & 0x7F != 0x7F else math.nan
                          for b in range(256)] for s in scales])
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_fp8_quantization_scales_each_row_or_the_tensor_to_448(name):
    """max |x| / 448 in float32 per row (or of the tensor), q = fp8(x / s): the largest magnitude is 448 s,
    a row of zeros stays zero, and the relative RMS error is e4m3's (measured: 2.5%)."""
    fmt = WEIGHT_FORMATS[name]
    x = np.random.default_rng(5).standard_normal((64, 1024)).astype(np.float32) * np.float32(3)
    x[0] = 0
    stored = fmt.quantize(x)
    scales = stored[:, :4].copy().view("<f4")[:, 0]
    y = fmt.dequantize(stored)
    assert not y[0].any() and np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean()) < 0.03
    if fmt.per_row:
        np.testing.assert_array_equal(scales[1:], np.abs(x[1:]).max(axis=1) / np.float32(448))
        np.testing.assert_array_equal(np.abs(y[1:]).max(axis=1), 448 * scales[1:].astype(np.float64))
    else:
        assert (scales == np.abs(x).max() / np.float32(448)).all()


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_an_fp8_checkpoint_stores_every_matrix_and_loads_its_exact_values(tmp_path, name):
    weights = load(generate.write_checkpoint(tmp_path, generate.small_config(), weight_format=name, shards=3))
    assert set(weights.weight_formats) == {n for n in weights if len(weights.info(n).shape) == 2}
    for tensor in ("model.embed_tokens.weight", "model.layers.5.mlp.down_proj.weight"):
        np.testing.assert_array_equal(weights[tensor], generate.tensor_values(tensor, weights.config, weight_format=name))
    assert weights["model.layers.5.input_layernorm.weight"].dtype == ml_dtypes.bfloat16


# ---- int4 with group scales (AWQ, GPTQ): fp16 scale, 4-bit zero point, 4-bit values --------------------

def fp16_value(bits: int) -> Fraction:
    """An fp16 bit pattern's value from its fields (sign, 5 exponent bits biased by 15, 10 mantissa bits;
    the exponent 0 subnormal): apart from numpy, which the format reads with. Finite patterns only."""
    sign, exponent, mantissa = bits >> 15, (bits >> 10) & 0x1F, bits & 0x3FF
    if exponent == 0:
        magnitude = Fraction(mantissa, 2 ** 24)
    else:
        magnitude = Fraction(1024 + mantissa, 2 ** 10) * Fraction(2) ** (exponent - 15)
    return -magnitude if sign else magnitude


@pytest.mark.parametrize("name", INT4_FORMATS)
def test_int4_dequantization_is_exact_against_integers_and_fractions(name):
    """Random groups (random bytes, finite fp16 scales of every magnitude, the edge scales: zeros, subnormals,
    the largest, negatives; zero points 0, 15 and random; the zero point's unused high nibble random): each
    value is s * (q - z) exactly, s from its bits' fields, q unpacked two to a byte, low nibble first."""
    fmt = WEIGHT_FORMATS[name]
    rng = np.random.default_rng(fmt.block)
    blocks = rng.integers(0, 256, (300, fmt.block_bytes), dtype=np.uint8)
    bits = rng.integers(0, 0x7C00, len(blocks)) | (rng.integers(0, 2, len(blocks)) << 15)
    bits[:len(EDGE_SCALES)] = EDGE_SCALES
    blocks[:, :2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    blocks[0::3, 2] = (blocks[0::3, 2] & 0xF0) | 15   # z = 15, z = 0, and the rest random
    blocks[1::3, 2] &= 0xF0
    ours = fmt.dequantize(blocks.reshape(10, -1))
    assert ours.shape == (10, 30 * fmt.block) and ours.dtype == np.float64
    expected = [[fp16_value(int(b)) * (q - int(group[2]) % 16)
                 for byte in group[3:] for q in (int(byte) % 16, int(byte) // 16)] for b, group in zip(bits, blocks)]
    assert [[Fraction(float(v)) for v in row] for row in ours.reshape(len(blocks), -1)] == expected
    assert (ours.reshape(len(blocks), -1)[:len(EDGE_SCALES)] != 0).any(axis=1).sum() == 8  # the edges reach values
    misread = fmt.dequantize_blocks(int4_zero_point_ignored(name, blocks))  # the check can fail
    assert [[Fraction(float(v)) for v in row] for row in misread.reshape(len(blocks), -1)] != expected


@pytest.mark.parametrize("name", INT4_FORMATS)
def test_int4_quantization_is_within_half_a_step_of_each_value(name):
    """AWQ's quantizer by each group's min and max: s = (max - min) / 15 stored in fp16, z = round(-min / s).
    Every value is within half a step s of its own, plus 15 times the step's fp16 rounding (the top of the
    group, clamped at q = 15); the relative RMS error of a normal draw is that of 4 bits (measured: 10%
    at G = 128, 8.1% at G = 32); a group of zeros stays zero."""
    fmt = WEIGHT_FORMATS[name]
    x = np.random.default_rng(5).standard_normal((64, 1024)).astype(np.float32) * np.float32(0.03)
    x[0] = 0
    stored = fmt.quantize(x)
    y = fmt.dequantize(stored)
    groups = x.reshape(-1, fmt.block).astype(np.float64)
    step = (groups.max(axis=1) - groups.min(axis=1)) / 15
    stored_step = stored.reshape(-1, fmt.block_bytes)[:, :2].copy().view("<f2").astype(np.float64)[:, 0]
    allowed = stored_step / 2 + 15 * np.abs(step - stored_step) + 1e-6 * stored_step
    assert (np.abs(y.reshape(-1, fmt.block) - groups) <= allowed[:, None]).all()
    assert not y[0].any() and (stored.reshape(-1, fmt.block_bytes)[:, 2] < 16).all()
    assert np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean()) < 0.12


@pytest.mark.parametrize("name", INT4_FORMATS)
def test_an_int4_checkpoint_stores_the_matrices_it_fits_and_loads_their_exact_values(tmp_path, name):
    """At hidden 64, 32-value groups fit every matrix; 128-value groups the rows of 128 values or more
    (o_proj, down_proj); the rest stay bf16. Streamed in chunks of whole groups (3 shards), the loaded
    values are the groups' exact values recomputed apart."""
    fmt = WEIGHT_FORMATS[name]
    weights = load(generate.write_checkpoint(tmp_path, generate.small_config(), weight_format=name, shards=3))
    matrices = {n: weights.info(n).shape for n in weights if len(weights.info(n).shape) == 2}
    assert set(weights.weight_formats) == {n for n, shape in matrices.items() if shape[1] % fmt.block == 0}
    assert set(weights.weight_formats) == (set(matrices) if fmt.block == 32 else
                                           {n for n in matrices if n.endswith(("o_proj.weight", "down_proj.weight"))})
    for tensor in ("model.layers.5.self_attn.o_proj.weight", "model.layers.5.mlp.down_proj.weight"):
        assert weights[tensor].dtype == np.float64
        np.testing.assert_array_equal(weights[tensor], generate.tensor_values(tensor, weights.config, weight_format=name))
    assert weights["model.layers.5.input_layernorm.weight"].dtype == ml_dtypes.bfloat16


# ---- quantized checkpoints: written, loaded, and the reference forward on their exact weights --------

def quantizable_config() -> dict:
    """The small geometry at hidden and intermediate 256, so that a k-quant's 256-value blocks fit every
    matrix, and 12 layers (two full ones) to keep the reference quick."""
    config = generate.small_config()
    config.update(hidden_size=256, intermediate_size=256, num_hidden_layers=12,
                  layer_types=config["layer_types"][:12])
    return config


TOKENS = np.array([3, 17, 99, 250, 7, 1, 400, 12, 3, 3])


@pytest.fixture(scope="module")
def bf16_logits(tmp_path_factory):
    weights = load(generate.write_checkpoint(tmp_path_factory.mktemp("bf16"), quantizable_config(), shards=1))
    return reference(weights.config, weights, TOKENS, certify=False)[0]["logits"]


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "fp8_e4m3_channel", "int4_g128"])
def test_the_reference_runs_on_a_quantized_checkpoint_s_exact_weights(tmp_path, bf16_logits, name):
    """The loader hands the graph each matrix's exact dequantized values: the reference forward on the
    quantized checkpoint is the reference on those values recomputed apart (tensor_values), to the bit,
    and differs from the bf16 checkpoint's by about the format's rounding (q4_k more than q8_0)."""
    weights = load(generate.write_checkpoint(tmp_path, quantizable_config(), weight_format=name))
    matrices = {n for n in weights if len(weights.info(n).shape) == 2}
    assert weights.weight_formats == dict.fromkeys(matrices, name)
    logits = reference(weights.config, weights, TOKENS, certify=False)[0]["logits"]
    recomputed = {n: generate.tensor_values(n, weights.config, weight_format=name) for n in weights}
    np.testing.assert_array_equal(logits, reference(weights.config, recomputed, TOKENS, certify=False)[0]["logits"])
    change = np.sqrt(((logits - bf16_logits) ** 2).mean() / (bf16_logits ** 2).mean())
    # measured (12 layers, these tokens): 2.3% for q8_0, 34% for q4_k, 10% for fp8_e4m3_channel, 38% for int4_g128
    assert {"q8_0": 0.005 < change < 0.1, "q4_k": 0.1 < change < 1, "fp8_e4m3_channel": 0.05 < change < 0.3,
            "int4_g128": 0.1 < change < 1}[name], change


def test_a_small_checkpoint_quantizes_the_matrices_a_format_fits(tmp_path):
    """At hidden 64 a q4_k block (256 values) fits only o_proj's rows (16 heads x 32); the rest stay bf16."""
    weights = load(generate.write_checkpoint(tmp_path, generate.small_config(), weight_format="q4_k", shards=3))
    assert set(weights.weight_formats) == {n for n in weights if n.endswith("o_proj.weight")}
    name = "model.layers.5.self_attn.o_proj.weight"
    assert weights[name].dtype == np.float64 and not weights[name].flags.writeable
    np.testing.assert_array_equal(weights[name], generate.tensor_values(name, weights.config, weight_format="q4_k"))
    assert weights["model.layers.5.mlp.down_proj.weight"].dtype == ml_dtypes.bfloat16


def rewrite_header(file, edit) -> None:
    """Rewrite the safetensors header of ``file`` as ``edit(header)`` (the data offsets are relative to the
    data, so the header's length may change)."""
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = edit(json.loads(raw[8:8 + n]))
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def declare(formats):
    """A header edit: the weight_formats metadata entry set to ``formats`` (a dict or raw text)."""
    def edit(header):
        header["__metadata__"][FORMATS_KEY] = formats if isinstance(formats, str) else json.dumps(formats)
        return header
    return edit


@pytest.fixture(scope="module")
def quantized_folder(tmp_path_factory):
    return generate.write_checkpoint(tmp_path_factory.mktemp("q8"), generate.small_config(), weight_format="q8_0", shards=1)


Q_PROJ = "model.language_model.layers.0.self_attn.q_proj.weight"
NORM = "model.language_model.layers.0.input_layernorm.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda formats: {**formats, Q_PROJ: "q3_k"},
     f"{Q_PROJ} in .*: unknown weight format 'q3_k'; the known formats are q8_0, q4_0, q4_k, q6_k"),
    (lambda formats: {**formats, Q_PROJ: "q4_0"}, f"{Q_PROJ} in .*: q4_0 blocks of shape \\[512, 68\\], "
                                                  f"expected \\[512, 36\\] for the \\[512, 64\\] matrix"),
    (lambda formats: {**formats, NORM: "q8_0"}, f"{NORM} in .*: declared q8_0 but stored as BF16"),
    (lambda formats: {**formats, "model.language_model.nothing": "q8_0"}, "nothing in .*: weight_formats "
                                                                          "declares a format for a tensor"),
    (lambda formats: "[1, 2", "corrupt __metadata__ entry 'weight_formats'"),
    (lambda formats: {k: v for k, v in formats.items() if k != Q_PROJ}, f"{Q_PROJ} in .*: unsupported dtype U8"),
], ids=["an unknown format", "blocks of another format", "a float tensor declared", "a tensor not in the file",
        "corrupt metadata", "blocks not declared"])
def test_a_quantized_checkpoint_that_does_not_hold_together_is_named(tmp_path, quantized_folder, edit, message):
    folder = tmp_path / "ck"
    shutil.copytree(quantized_folder, folder)
    file = folder / "model.safetensors"
    formats = json.loads(json.loads(file.read_bytes()[8:8 + struct.unpack("<Q", file.read_bytes()[:8])[0]])
                         ["__metadata__"][FORMATS_KEY])
    rewrite_header(file, declare(edit(formats)))
    with pytest.raises(CheckpointError, match=message):
        load(folder)


def test_writing_an_unknown_format_is_refused_before_any_file(tmp_path):
    with pytest.raises(UnknownWeightFormat, match="unknown weight format 'Q4_K_M'; the known formats are"):
        generate.write_checkpoint(tmp_path / "ck", generate.small_config(), weight_format="Q4_K_M")
    assert not (tmp_path / "ck").exists()


def test_the_generator_s_command_line_writes_a_quantized_checkpoint(tmp_path, capsys):
    generate.main([str(tmp_path), "--weight-format", "q6_k", "--shards", "1"])
    assert set(load(tmp_path).weight_formats.values()) == {"q6_k"}
