"""llama.cpp's products on quantized weights at op level (``LlamaCpp.linear``, ``gate_up``, ``lm_head``:
ggml_mul_mat through ggml's CPU backend, ``llama_cpp_backend.Products``), held against the exact sums of the
weights' exact values and x rounded as declared.  Skipped without llama-cpp-python, as tests/test_llama_cpp.py.

**The bound.** For a weight W in a block format, with x̂ = x rounded to the declared activation blocks
(``rounded_activations``, what ggml's ``quantize_row_q8_0`` / ``quantize_row_q8_K`` or the repacked kernels'
``quantize_mat_*`` store), each of ggml's CPU kernels here forms integer dot products of W's and x̂'s blocks
(or sub-blocks) exactly and sums in float32 P terms, each a product of at most three float32 values, the
scales' product and the integer converted to float32, each exact or one rounding away: P ≤ K terms each
within γ_3 of its exact value, summed in any order within γ_{P-1} of their sum (Higham, Accuracy and
Stability, 3.1 and 4.2).  So

    |y − Σ_k W_k x̂_k| ≤ γ_{K+2} Σ_k M_k |x̂_k|,   γ_n = n u / (1 − n u), u = 2⁻²⁴,

with M_k = |W_k|, except for q4_k, whose kernels sum the scales' part d sc_j q and the minima's dmin m_j
apart: M_k = |d sc_j q_k| + |dmin m_j|.  A W with one wrong scale lands far outside it, and so does the
product of the unrounded x: the rounding declared is the rounding done.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from gemma4_conformance.adapters.contract import Unsupported
from gemma4_conformance.checkpoints.quantized import WEIGHT_FORMATS, QuantizedWeight, rounded_activations
from tests.test_llama_cpp import _engine

FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k")
ACTIVATIONS = {"q8_0": "q8_0", "q4_0": "q8_0", "q4_k": "q8_k", "q6_k": "q8_k"}
K = 512  # two k-quant super-blocks, 16 q8_0 blocks
# Rows: 16 puts Q4_0 and Q4_K weights in CPU_REPACK's interleaved layout (AVX2's GEMM kernels) where the CPU
# has AVX2; 12 (not a multiple of 8) keeps every format in the plain CPU buffer (vec_dot, tinyBLAS).
ROWS = (16, 12)
TOKENS = (1, 5)  # one row takes ggml's gemv / vec_dot path, several its gemm / tinyBLAS path
U = 2.0**-24
# The high byte of each block's fp16 d (the first of a q4_k block's two scales)
SCALE_HIGH_BYTE = {"q8_0": 1, "q4_0": 1, "q4_k": 1, "q6_k": 209}
POWER_OF_TWO_SCALE = np.array([2.0**-6], "<f2").view(np.uint8)  # fp16 2^-6, two little-endian bytes


def _adapter(**options):
    return _engine(threads="2", **options)


@pytest.fixture(scope="module")
def engines():
    made = {fmt: _adapter(weights=fmt) for fmt in FORMATS}
    yield made
    for adapter in made.values():
        adapter.close()


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def magnitudes(W: QuantizedWeight) -> np.ndarray:
    """M (module docstring): |W|, and for q4_k |d sc q| + |dmin m|, the minima's part being the value of the
    blocks with every 4-bit q zeroed (-dmin m)."""
    values = W.values()
    if W.format != "q4_k":
        return np.abs(values)
    f = WEIGHT_FORMATS["q4_k"]
    blocks = W.stored.reshape(-1, f.block_bytes).copy()
    blocks[:, 16:] = 0
    minima = f.dequantize(blocks.reshape(W.stored.shape))
    return np.abs(values - minima) + np.abs(minima)


def bound(W: QuantizedWeight, rounded: np.ndarray) -> np.ndarray:
    return gamma(W.shape[1] + 2) * (np.abs(rounded) @ magnitudes(W).T)


def drawn(fmt: str, N: int, T: int, seed: int, spread: float = 8) -> tuple[QuantizedWeight, np.ndarray]:
    """W quantized from normal values, and x whose 32-value groups have magnitudes 2^-spread to 2^spread apart."""
    rng = np.random.default_rng(seed)
    W = QuantizedWeight.of(fmt, rng.standard_normal((N, K)))
    scales = 2.0 ** rng.uniform(-spread, spread, (T, K // 32, 1))
    x = (rng.standard_normal((T, K // 32, 32)) * scales).reshape(T, K).astype(np.float32)
    return W, x


@pytest.mark.parametrize("fmt", FORMATS)
def test_products_are_the_exact_sums_of_the_declared_roundings_within_float32_accumulation(engines, fmt):
    engine = engines[fmt]
    for N in ROWS:
        for T in TOKENS:
            for seed in range(3):
                W, x = drawn(fmt, N, T, seed)
                got = engine.linear(W, x).astype(np.float64)
                rounded = rounded_activations(x, ACTIVATIONS[fmt])
                allowed = bound(W, rounded)
                assert np.all(np.abs(got - rounded @ W.values().T) <= allowed), (fmt, N, T, seed)
                # the product of x unrounded is outside: the bound tells the declared rounding apart
                assert np.any(np.abs(got - x.astype(np.float64) @ W.values().T) > allowed), (fmt, N, T, seed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_weight_with_one_wrong_scale_lands_outside_the_bound(engines, fmt):
    engine = engines[fmt]
    for N in ROWS:
        W, x = drawn(fmt, N, 5, seed=7, spread=0)  # every block counts alike: the wrong one too
        wrong = W.stored.copy()
        wrong[3, SCALE_HIGH_BYTE[fmt]] ^= 0x04  # the exponent's lowest bit: row 3's first block's d doubled or halved
        got = engine.linear(QuantizedWeight(fmt, wrong, W.shape), x).astype(np.float64)
        rounded = rounded_activations(x, ACTIVATIONS[fmt])
        outside = np.abs(got - rounded @ W.values().T) > bound(W, rounded)
        assert outside[:, 3].all() and not np.delete(outside, 3, axis=1).any(), (fmt, N)


def on_the_grid(fmt: str, N: int, T: int, seed: int) -> tuple[QuantizedWeight, np.ndarray]:
    """W with every fp16 scale (d, and q4_k's dmin) 2^-6, and x on the activation format's grid: per block small
    integers and one ±127, times a power of two; x rounds to itself, and every term and partial sum of the
    kernels is an integer multiple of the smallest unit, below 2^24 of them (checked), so float32 sums them
    exactly."""
    rng = np.random.default_rng(seed)
    W, _ = drawn(fmt, N, T, seed)
    f = WEIGHT_FORMATS[fmt]
    blocks = W.stored.reshape(-1, f.block_bytes).copy()
    offsets = {"q6_k": (208,), "q4_k": (0, 2)}.get(fmt, (0,))
    for offset in offsets:
        blocks[:, offset:offset + 2] = POWER_OF_TWO_SCALE
    W = QuantizedWeight(fmt, blocks.reshape(W.stored.shape), W.shape)
    block = 32 if ACTIVATIONS[fmt] == "q8_0" else 256
    integers = rng.integers(-3, 4, (T, K // block, block))
    integers[:, :, 0] = rng.choice([-127, 127], (T, K // block))
    exponents = rng.integers(-4, -2, (T, K // block, 1))
    x = (integers * 2.0**exponents).reshape(T, K).astype(np.float32)
    units = (np.abs(x.astype(np.float64)) @ magnitudes(W).T) / (2.0**-6 * 2.0**-4)
    assert units.max() < 2**24, "the test's draw would not sum exactly in float32"
    return W, x


@pytest.mark.parametrize("fmt", FORMATS)
def test_on_the_activation_grid_the_product_is_exact(engines, fmt):
    """x that the declared rounding leaves as it is and sums float32 adds exactly: llama.cpp's result is the exact
    Σ_k W_k x_k, bit for bit, in every kernel (repacked and not, one token and several)."""
    engine = engines[fmt]
    for N in ROWS:
        for T in TOKENS:
            W, x = on_the_grid(fmt, N, T, seed=N + T)
            assert np.array_equal(rounded_activations(x, ACTIVATIONS[fmt]), x)
            exact = x.astype(np.float64) @ W.values().T
            assert np.array_equal(engine.linear(W, x).astype(np.float64), exact), (fmt, N, T)


def test_the_weights_go_where_llama_cpps_loader_puts_them(engines):
    """CPU_REPACK for Q4_0 and Q4_K of a multiple of 8 rows on an AVX2 CPU (select_weight_buft), else the CPU
    buffer, so that the op tests run the kernels llama.cpp's forward runs."""
    engine = engines["q8_0"]
    engine.linear(*drawn("q8_0", 16, 1, seed=0))
    products = engine._products
    placed = {(fmt, N): products.buffer_name(fmt, N, K) for fmt in FORMATS for N in ROWS}
    repacked = {key for key, name in placed.items() if name == "CPU_REPACK"}
    assert set(placed.values()) <= {"CPU", "CPU_REPACK"}
    assert repacked in (set(), {("q4_0", 16), ("q4_k", 16)})  # the second on AVX2, as here


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bfloat16_and_float16_are_the_float32_product_rounded_once(engines, dtype):
    engine = engines["q4_k"]
    W, x = drawn("q4_k", 16, 5, seed=3)
    x = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    got = engine.linear(W, x)
    assert got.dtype == x.dtype
    assert np.array_equal(got.view(np.uint16), engine.linear(W, x.astype(np.float32)).astype(x.dtype).view(np.uint16))


def test_gate_up_joins_the_two_products_gate_first(engines):
    engine = engines["q6_k"]
    Wg, x = drawn("q6_k", 16, 5, seed=4)
    Wu, _ = drawn("q6_k", 16, 5, seed=5)
    x = x.reshape(5, 1, K)  # any leading axes
    got = engine.gate_up(Wg, Wu, x)
    assert got.shape == (5, 1, 32)
    assert np.array_equal(got, np.concatenate([engine.linear(Wg, x), engine.linear(Wu, x)], axis=-1))


def test_lm_head_scales_and_caps_the_product_as_llama_cpps_gemma_graph(engines):
    """mul 1 and no cap: the product itself; mul alone: one float32 multiplication (ggml_scale); with a cap:
    mul L / cap formed in float32 (mul and 1/cap rounded, two products: 4u relative), tanhf (glibc: 2 ULPs),
    times cap (rounded, one product): within 5u |mul L| + 7u |y| of cap tanh(mul L / cap) on its own L."""
    engine = engines["q8_0"]
    W, x = drawn("q8_0", 16, 5, seed=6)
    L = engine.linear(W, x)
    assert np.array_equal(engine.lm_head(1.0, None, W, x), L)
    mul = 0.3
    assert np.array_equal(engine.lm_head(mul, None, W, x), L * np.float32(mul))
    for cap in (30.0, 0.7):
        got = engine.lm_head(mul, cap, W, x).astype(np.float64)
        scaled = mul * L.astype(np.float64)
        want = cap * np.tanh(scaled / cap)
        assert np.all(np.abs(got - want) <= 5 * U * np.abs(scaled) + 7 * U * np.abs(want))
        assert not np.array_equal(got, scaled)  # the cap is applied


def test_what_llama_cpps_products_do_not_take_is_refused(engines):
    engine = engines["q8_0"]
    W, x = drawn("q8_0", 16, 1, seed=0)
    refused = {
        "float64": (W, x.astype(np.float64)),
        "a plain array": (W.values().astype(np.float32), x),
        "int4": (QuantizedWeight.of("int4_g32", W.values()), x),
        "fp8": (QuantizedWeight.of("fp8_e4m3_channel", W.values()), x),
        "another block format": (QuantizedWeight.of("q4_0", W.values()), x),
    }
    says = {"float64": "runs x in float32, bfloat16, float16", "a plain array": "got W as ndarray",
            "int4": "got a int4_g32 QuantizedWeight", "fp8": "got a fp8_e4m3_channel QuantizedWeight",
            "another block format": "declares weights=q8_0, and linear was handed q4_0 blocks"}
    for case, args in refused.items():
        with pytest.raises(Unsupported, match=says[case]):
            engine.linear(*args)
    with pytest.raises(Unsupported, match="gate_up takes W as a QuantizedWeight"):
        engine.gate_up(W, W.values(), x)
    with pytest.raises(Unsupported, match="reads a softcap of 0 as no cap"):
        engine.lm_head(1.0, 0.0, W, x)


def test_the_option_declares_the_weights_and_their_activation_format(engines):
    from gemma4_conformance import adapters

    assert {fmt: e.formats for fmt, e in engines.items()} == {
        "q8_0": {"weights": "q8_0", "activations": "q8_0"}, "q4_0": {"weights": "q4_0", "activations": "q8_0"},
        "q4_k": {"weights": "q4_k", "activations": "q8_k"}, "q6_k": {"weights": "q6_k", "activations": "q8_k"}}
    loaded = adapters.load("llama.cpp[weights=q4_k,threads=1]")
    assert adapters.declared_formats(loaded) == {"weights": "q4_k", "activations": "q8_k"}
    assert "op tests: q4_k weights" in loaded.notes
    with pytest.raises(adapters.AdapterError, match=r"weights='int4_g32': llama.cpp's op tests take W in one of "
                                                    r"GGUF's block formats q8_0, q4_0, q4_k, q6_k"):
        adapters.load("llama.cpp[weights=int4_g32]")
    assert _adapter().formats == {}  # without it: what the GGUF of a forward rounds (tests/test_llama_cpp.py)


class FakeModel:
    def __init__(self, types, formats):
        self.block_types, self.formats = types, formats


@pytest.mark.parametrize("types, formats, refused", [
    (set(), {}, False),                                        # a float GGUF: the declaration holds unused
    ({"Q4_K", "Q6_K"}, {"activations": "q8_k"}, False),        # Q4_K_M: holds q4_k, rounds x to q8_k
    ({"Q8_0"}, {"activations": "q8_0"}, True),                 # another family
    ({"Q6_K"}, {"activations": "q8_k"}, True),                 # the same activations, not the declared blocks
])
def test_the_forward_and_session_refuse_a_gguf_beyond_the_declaration(tmp_path, types, formats, refused):
    """Both load their GGUF through ``_model``: with the option, a quantized GGUF must hold the declared block
    type and round x as declared; a float GGUF runs (its products round nothing the declaration names)."""
    engine = _adapter(weights="q4_k")
    path = tmp_path / "model.gguf"
    engine.gguf = lambda checkpoint, dtype: path
    engine._models[path] = FakeModel(types, formats)
    if refused:
        with pytest.raises(ValueError, match=r"declares weights=q4_k \(activations q8_k\), and .*model.gguf holds"):
            engine._model(None, "float32")
    else:
        assert engine._model(None, "float32") is engine._models[path]
    assert engine.formats == {"weights": "q4_k", "activations": "q8_k"}  # never the GGUF's
    plain = _adapter()
    plain.gguf = engine.gguf
    plain._models[path] = engine._models[path]
    assert plain._model(None, "float32") is engine._models[path] and plain.formats == formats


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident memory from Linux's /proc")
def test_no_memory_is_kept_across_calls(engines):
    """Every call frees its two ggml contexts and buffers: 2000 calls keep the resident memory within 8 MiB
    (a context kept per call would be its graph's metadata, over 100 kB each: 200 MB)."""
    engine = engines["q4_k"]
    W, x = drawn("q4_k", 16, 5, seed=8)
    for _ in range(200):
        engine.linear(W, x)
    before = rss()
    for _ in range(2000):
        engine.linear(W, x)
    assert rss() - before < 8 * 2**20
