"""Declared formats: each declared rounding's derived term holds on the inputs that make it largest and is
at most 4 times the exact error there; an engine that rounds its activations to q8_0 passes when it
declares so, and fails when it does not; the verdict says "given its declared formats" and lists them."""

from __future__ import annotations

import json
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from gemma4_conformance.plugin import EXIT_CONFORMANT, EXIT_NOT_CONFORMANT
from gemma4_conformance.properties import error_models
from gemma4_conformance.properties.judging import BeyondDeclared, assess, judge
from gemma4_conformance.adapters import DECLARED_FORMATS
from gemma4_conformance.checkpoints.quantized import FP8_ACTIVATIONS, FP8_TYPES, WEIGHT_FORMATS, fp8_scale, rounded_to_fp8
from tests.quantized_engines import (DECLARED, FP8_DECLARED, FP8_FORMATS, FP8_STATIC, FP8_UNDECLARED, UNDECLARED,
                                     Fp8Products, rounded_to_q8_0)
from tests.test_plugin import suite

TIGHT = 4  # the derived bound may be at most this many times the exact error on the worst draw


def rounded_to_q8_k(x: np.ndarray) -> np.ndarray:
    """llama.cpp's ``quantize_row_q8_K_ref`` and its dequantization, in float32 as it computes: per block
    of 256, iscale = -127 / the signed extreme, q = nearest_int(iscale * x) capped at 127, d = 1 / iscale."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(-1, 256)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    nonzero = extreme != 0
    iscale = np.where(nonzero, np.float32(-127) / np.where(nonzero, extreme, np.float32(1)), np.float32(0))
    q = np.minimum(np.rint(iscale * blocks), 127)
    d = np.where(nonzero, np.float32(1) / np.where(nonzero, iscale, np.float32(1)), np.float32(0))
    return (d.astype(np.float64) * q).reshape(x.shape)


ROUNDERS = {"q8_0": (32, rounded_to_q8_0), "q8_k": (256, rounded_to_q8_k)}


@st.composite
def worst_blocks(draw, block: int):
    """A row of blocks near the term's worst case: each block's scale d an fp16 value moved by up to half
    its ULP (the stored scale's rounding at its largest), its extreme 127 d, and every other value an
    integer multiple of d plus about a drawn fraction of a step (the element's rounding: largest at a
    half), the multiples and the spread around the fraction from a drawn seed."""
    values = []
    for _ in range(draw(st.integers(1, 2))):
        mantissa, exponent = draw(st.integers(1024, 2047)), draw(st.integers(-20, 12))
        d = np.float32((mantissa + draw(st.floats(-0.5, 0.5))) * 2.0 ** (exponent - 10))
        fraction, spread = draw(st.floats(-0.5, 0.5)), draw(st.floats(0, 0.5))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        steps = rng.integers(-127, 128, block - 1)
        halves = np.clip(fraction + rng.uniform(-spread, spread, block - 1), -0.5, 0.5)
        row = np.concatenate([[np.float32(127) * d], ((steps + halves) * d).astype(np.float32)])
        values.append(rng.permutation(row))
    values = np.concatenate(values).astype(np.float32)
    weights = 2.0 ** np.random.default_rng(draw(st.integers(0, 2**32 - 1))).uniform(-4, 2, len(values))
    return values, weights


@pytest.mark.parametrize("name", ["q8_0", "q8_k"])
def test_the_activation_term_holds_and_is_within_4_times_the_worst_error(name):
    """sum_k W_k (x_k - x^_k) with W_k signed as x_k - x^_k, the error's largest arrangement: exact (in
    rationals) within the term of one linear output, and on the worst draw the term at most 4 times it."""
    block, rounded = ROUNDERS[name]
    ratios = []

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(worst_blocks(block))
    def draw(case):
        x, magnitudes = case
        error_per_element = x.astype(np.float64) - rounded(x)
        W = (np.where(error_per_element < 0, -1.0, 1.0) * magnitudes)[None, :]
        exact = abs(sum(Fraction(float(w)) * (Fraction(float(a)) - Fraction(float(b)))
                        for w, a, b in zip(W[0], x, rounded(x))))
        bound = error_models.declared_activations((W, x.astype(np.float64)), "float32", name)[1][0]
        assert exact <= Fraction(float(bound)), (float(exact), float(bound))
        ratio = float(exact) / float(bound)
        target(ratio, label="error / term")
        ratios.append(ratio)

    draw()
    assert max(ratios) * TIGHT >= 1, f"the term is {1 / max(ratios):.3g} times the worst error found"


def test_a_block_of_zeros_is_exact_and_a_scale_past_fp16_has_no_bound():
    assert (error_models.activation_rounding(np.zeros((2, 40)), "q8_0") == 0).all()
    beyond = np.full((1, 32), 127 * 65520.0)
    assert np.isinf(error_models.activation_rounding(beyond, "q8_0")).all()
    assert np.isfinite(error_models.activation_rounding(beyond, "q8_k")).all()  # a float32 scale holds it


CASES = [  # (op, dtype, case): x spread wider than q8_0's 8 bits hold
    ("linear", "float32", {"args": {"x": {"shape": [3, 64], "dist": "wide", "log2": 0, "seed": 1},
                                    "W": {"shape": [8, 64], "dist": "wide", "log2": 0, "seed": 2}}, "cancel": None}),
    ("gate_up", "float32", {"args": {"x": {"shape": [2, 40], "dist": "wide", "log2": 2, "seed": 3},
                                     "Wg": {"shape": [3, 40], "dist": "wide", "log2": 0, "seed": 4},
                                     "Wu": {"shape": [3, 40], "dist": "wide", "log2": 0, "seed": 5}}, "cancel": None}),
    ("lm_head", "bfloat16", {"args": {"x": {"shape": [2, 64], "dist": "wide", "log2": 0, "seed": 6},
                                      "W": {"shape": [33, 64], "dist": "wide", "log2": 0, "seed": 7},
                                      "mul": 0.5, "cap": None}, "cancel": None}),
    ("lm_head", "float32", {"args": {"x": {"shape": [2, 64], "dist": "normal", "log2": 0, "seed": 6},
                                     "W": {"shape": [33, 64], "dist": "normal", "log2": 0, "seed": 7},
                                     "mul": 0.5, "cap": 30.0}, "cancel": None}),
]


@pytest.mark.parametrize("op, dtype, case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_rounding_activations_to_q8_0_passes_declared_and_fails_undeclared(op, dtype, case):
    declared = judge(DECLARED, op, case, dtype)
    assert declared.passed and declared.formats == {"activations": "q8_0"} and declared.informative
    # in float32 q8_0's 8 bits dwarf the dtype's roundings; in bfloat16 they are of one size
    assert declared.declared_dominates if dtype == "float32" else declared.declared_share > 0.25
    undeclared = judge(UNDECLARED, op, case, dtype)
    assert not undeclared.passed and undeclared.formats == {}


def test_a_declared_format_adds_nothing_to_ops_it_has_no_term_for():
    x = np.linspace(-3, 3, 16, dtype=np.float32).reshape(2, 8)
    out = np.asarray(1 / (1 + np.exp(-x.astype(np.float64))), dtype=np.float32)
    verdict = assess("sigmoid", (x,), out, "float32", formats={"activations": "q8_0"})
    assert verdict.formats == {} and verdict.declared_share == 0


def test_inputs_a_declared_format_cannot_hold_are_not_judged():
    x = np.full((1, 32), 127 * 70000.0, dtype=np.float32)
    W = np.ones((2, 32), dtype=np.float32)
    with pytest.raises(BeyondDeclared, match="the declared activations format q8_0 cannot hold these inputs"):
        assess("linear", (W, x), DECLARED.linear(W, x), "float32", formats={"activations": "q8_0"})


def test_the_run_reads_conformant_given_its_declared_formats(tmp_path):
    status, out, doc = suite(tmp_path, "--backend=tests.quantized_engines:DECLARED", "--ops=linear",
                             "-k", "test_matches_oracle")
    assert status == EXIT_CONFORMANT, out
    assert "(given its declared formats: numpy-q8_0-activations: activations q8_0)" in out
    (result,) = doc["results"]
    assert result["formats"] == {"activations": "q8_0"} and result["given"].startswith("given its declared formats")
    assert "Declared activations (q8_0)" in result["error_model"]
    assert doc["environment"]["backends"]["numpy-q8_0-activations"]["formats"] == {"activations": "q8_0"}
    assert "conformant given its declared formats" in (tmp_path / "report.html").read_text()
    status, out, doc = suite(tmp_path, "--backend=tests.quantized_engines:UNDECLARED", "--ops=linear",
                             "-k", "test_matches_oracle")
    assert status == EXIT_NOT_CONFORMANT, out
    assert "declared formats" not in out and doc["results"][0]["formats"] == {}


# ---- fp8 inputs of the products ----------------------------------------------------------------------

def test_the_declared_fp8_formats_are_those_with_a_term():
    assert set(FP8_ACTIVATIONS) <= set(DECLARED_FORMATS["activations"])
    assert set(error_models.FP8_WEIGHTS) == {name for name, fmt in WEIGHT_FORMATS.items() if not fmt.ggml_type}
    assert set(error_models.FP8_WEIGHTS) <= set(DECLARED_FORMATS["weights"])
    for kind, (m, emin, largest) in error_models.FP8.items():
        info = ml_dtypes.finfo(FP8_TYPES[kind])
        assert (info.nmant, info.minexp, float(info.max)) == (m, emin, largest)


@st.composite
def worst_fp8_rows(draw, kind: str, per_row: bool):
    """Rows of values near the term's worst case: each row's (or the tensor's) largest magnitude a drawn
    float32, its scale s = a / M as the engine forms it, every other value s times an fp8 value plus about
    a drawn fraction of its spacing (half a spacing is the rounding's worst), normals and subnormals, the
    fraction's spread and the fp8 values from a drawn seed; weights 2^[-4, 2]."""
    m, emin, largest = error_models.FP8[kind]
    rows, K = draw(st.integers(1, 2)), draw(st.integers(2, 48))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    a = np.float32(draw(st.floats(2.0**-100, 2.0**100)))
    peaks = np.full(rows, a) if per_row else np.where(np.arange(rows) == 0, a, a / np.float32(draw(st.floats(1, 8))))
    fraction, spread = draw(st.floats(-0.5, 0.5)), draw(st.floats(0, 0.5))
    x = np.empty((rows, K), dtype=np.float32)
    for r in range(rows):
        s = np.float64(fp8_scale(np.array([a if per_row else peaks[0]], dtype=np.float32), kind, True)[0])
        exponents = rng.integers(emin - m, int(np.log2(largest)), K - 1)  # subnormal spacings included
        grid = np.abs(rng.integers(0, 2**(m + 1), K - 1)) * 2.0 ** (np.maximum(exponents, emin) - m)
        grid = np.minimum(grid + 2.0 ** np.maximum(exponents, emin) * (exponents >= emin), largest / 2)
        spacing = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(grid, 2.0**emin))), emin) - m)
        t = grid + np.clip(fraction + rng.uniform(-spread, spread, K - 1), -0.5, 0.5) * spacing
        row = np.concatenate([[peaks[r]], (t * s * np.where(rng.random(K - 1) < 0.5, -1, 1))]).astype(np.float32)
        x[r] = rng.permutation(row) if per_row or r else row
    magnitudes = 2.0 ** rng.uniform(-4, 2, K)
    return x, magnitudes


def _exact(W, x, x_rounded, W_rounded):
    """|sum_k W_k x_k - W^_k x^_k| per row of x, in rationals."""
    return [abs(sum(Fraction(float(w)) * Fraction(float(a)) - Fraction(float(wr)) * Fraction(float(b))
                    for w, a, wr, b in zip(W, row, W_rounded, rounded))) for row, rounded in zip(x, x_rounded)]


FP8_CASES = [("activations", name) for name in FP8_ACTIVATIONS] + \
            [("weights", name) for name in error_models.FP8_WEIGHTS]


@pytest.mark.parametrize("key, name", FP8_CASES, ids=[f"{key}-{name}" for key, name in FP8_CASES])
def test_the_fp8_terms_hold_and_are_within_4_times_the_worst_error(key, name):
    """One output of a linear whose rounded operand (x for activations, W's row for weights) is drawn near
    the term's worst case and whose other operand is signed as each element's error: the exact error (in
    rationals) inside the term, and on the worst draw the term at most 4 times it."""
    kind, per_row = (FP8_ACTIVATIONS if key == "activations" else error_models.FP8_WEIGHTS)[name]
    ratios = []

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(worst_fp8_rows(kind, per_row))
    def draw(case):
        values, magnitudes = case
        rounded = rounded_to_fp8(values, kind, per_row)
        signs = np.where(values.astype(np.float64) - rounded < 0, -1.0, 1.0)
        if key == "activations":
            x, W = values[:1].astype(np.float64), signs[:1] * magnitudes
            exact = _exact(W[0], x, rounded[:1], W[0])
            bound = error_models.declared_activations((W, x), "float32", name)[1][:, 0]
        else:  # the rows of W are the drawn values; x one token signed as the first row's errors
            W, x = values.astype(np.float64), (signs[:1] * magnitudes)
            exact = [_exact(row, x, x, wr)[0] for row, wr in zip(W, rounded)]
            bound = error_models.declared_weights((W, x), "float32", name)[1][0]
        for e, b in zip(exact, bound):
            assert e <= Fraction(float(b)), (float(e), float(b))
        ratio = max(float(e) / float(b) for e, b in zip(exact, bound))
        target(ratio, label="error / term")
        ratios.append(ratio)

    draw()
    assert max(ratios) * TIGHT >= 1, f"the term is {1 / max(ratios):.3g} times the worst error found"


@pytest.mark.parametrize("kind", list(FP8_TYPES))
def test_the_fp8_bound_is_half_the_spacing_at_every_midpoint_subnormals_included(kind):
    """Every point half-way between two consecutive positive fp8 values (ml_dtypes' own, all 256 bit
    patterns), at scale 1 (a row whose largest is M): the rounding's error there is half their spacing,
    and the bound is that within float32's roundings."""
    every = np.arange(256, dtype=np.uint8).view(FP8_TYPES[kind]).astype(np.float64)
    values = np.unique(every[np.isfinite(every) & (every >= 0)])
    midpoints = (values[:-1] + values[1:]) / 2
    row = np.concatenate([[values[-1]], midpoints]).astype(np.float32)[None, :]
    error = np.abs(row.astype(np.float64) - rounded_to_fp8(row, kind, True))[0, 1:]
    bound = error_models.fp8_rounding(row, kind, True)[0, 1:]
    np.testing.assert_array_equal(error, np.diff(values) / 2)
    assert (error <= bound).all() and (bound <= error * (1 + 2.0**-16)).all()  # 3u |x| is under 2^-17 of it


def test_fp8_rounding_of_zeros_is_exact_and_a_scale_below_float32s_normals_has_no_bound():
    assert (error_models.fp8_rounding(np.zeros((2, 8)), "e4m3", True) == 0).all()
    row = np.array([[0.0, 1.0, -3.0]])
    bound = error_models.fp8_rounding(row, "e4m3", True)
    assert bound[0, 0] == 0 and (bound[0, 1:] > 0).all()
    tiny = np.full((1, 4), 448 * 2.0**-127)
    assert np.isinf(error_models.fp8_rounding(tiny, "e4m3", True)).all()
    assert np.isfinite(error_models.fp8_rounding(tiny * 2, "e4m3", True)).all()


def test_dynamic_scaling_never_saturates():
    """|x / s| passes 448 by float32's roundings at most, so the largest value rounds to 448, not NaN."""
    x = np.array([[np.float32(3.4e38), -np.float32(3.4e38), np.float32(1e-30)]], dtype=np.float32)
    rounded = rounded_to_fp8(x, "e4m3", True)
    assert np.isfinite(rounded).all()
    assert (np.abs(x - rounded) <= error_models.fp8_rounding(x, "e4m3", True)).all()


FP8_ENGINE_CASES = [case for case in CASES]


@pytest.mark.parametrize("op, dtype, case", FP8_ENGINE_CASES, ids=[f"{c[0]}-{c[1]}" for c in FP8_ENGINE_CASES])
def test_fp8_products_pass_declared_and_fail_undeclared(op, dtype, case):
    declared = judge(FP8_DECLARED, op, case, dtype)
    assert declared.passed and declared.formats == FP8_FORMATS and declared.informative
    assert declared.declared_dominates
    undeclared = judge(FP8_UNDECLARED, op, case, dtype)
    assert not undeclared.passed and undeclared.formats == {}


@pytest.mark.parametrize("formats, activations, weights", [
    ({"activations": "fp8_e5m2_tensor"}, ("e5m2", False), None),
    ({"weights": "fp8_e4m3_tensor"}, None, ("e4m3", False)),
    ({"activations": "fp8_e4m3_tensor", "weights": "fp8_e4m3_channel"}, ("e4m3", False), ("e4m3", True))])
def test_each_fp8_declaration_covers_its_rounding_which_fails_undeclared(formats, activations, weights):
    op, dtype, case = CASES[0]
    engine = Fp8Products("numpy-fp8", formats, activations, weights)
    assert judge(engine, op, case, dtype).passed
    assert not judge(Fp8Products("numpy-fp8", None, activations, weights), op, case, dtype).passed


def test_a_block_weight_format_adds_no_term():
    op, dtype, case = CASES[0]
    verdict = judge(Fp8Products("numpy-fp8-weights-said-q8_0", {"weights": "q8_0"}, None), op, case, dtype)
    assert not verdict.passed and verdict.formats == {}


def test_an_fp8_engine_whose_static_scale_saturates_fails_though_it_declares_fp8():
    """A scale not taken from x (calibrated once) clamps every value past it to 448 s: the declared formats
    are dynamic, whose scaling never saturates, so their terms do not cover it."""
    op, dtype, case = CASES[0]
    verdict = judge(FP8_STATIC, op, case, dtype)
    assert verdict.formats == FP8_FORMATS and not verdict.passed


def test_e4m3fn_overflow_is_nan_and_an_engine_returning_it_fails():
    """e4m3fn has no infinity: a conversion that does not saturate gives NaN past 464, and the product NaN."""
    assert np.isnan(np.float32(500).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert np.float32(460).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) == 448
    nan_on_overflow = Fp8Products("numpy-fp8-nan", FP8_FORMATS, rounds_x=lambda x: (
        np.asarray(x, dtype=np.float32) * np.float32(448)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / 448)
    op, dtype, case = CASES[0]
    assert not judge(nan_on_overflow, op, case, dtype).passed


def test_torch_fp8_runs_scaled_mm_and_is_conformant_given_its_declared_formats():
    """torch[fp8=e4m3] (torch._scaled_mm on the CPU) passes with its declared formats and fails without."""
    torch_backend = pytest.importorskip("gemma4_conformance.adapters.torch_backend")
    from gemma4_conformance.adapters import AdapterError, load

    for option, formats in torch_backend.FP8.items():
        engine = load(f"torch[fp8={option}]")
        assert engine.formats == formats[1] and "float64" not in engine.dtypes
        for op, dtype, case in CASES:
            assert judge(engine, op, case, dtype).passed
        engine.formats = {}
        op, dtype, case = CASES[0]
        assert not judge(engine, op, case, dtype).passed
    with pytest.raises(AdapterError, match=r"fp8 is one of e4m3, e4m3-tensor, not 'e5m2'"):
        load("torch[fp8=e5m2]")


@pytest.mark.parametrize("engine", [DECLARED, FP8_DECLARED], ids=lambda e: e.name)
def test_the_relations_leave_out_inputs_the_declared_formats_cannot_hold(engine):
    """float64 inputs past fp16's range times 127 (q8_0's scale) and float32's (fp8's): both sides of
    gate_up = [linear | linear] are NaN there, outside the declaration as in the op tests; the same
    relation still fails an engine whose halves differ."""
    from gemma4_conformance.properties.relations import RELATIONS

    case = {"args": {"x": {"shape": [2, 5, 1], "dist": "specials", "log2": 0, "seed": 28},
                     "Wg": {"shape": [1, 1], "dist": "normal", "log2": 0, "seed": 0},
                     "Wu": {"shape": [1, 1], "dist": "normal", "log2": 0, "seed": 0}}, "cancel": None}
    relation = RELATIONS["gate_up_is_two_linears"]
    assert relation.check(engine, case, "float64") == []
    held = {"args": {"x": {"shape": [2, 5, 8], "dist": "normal", "log2": 0, "seed": 1},
                     "Wg": {"shape": [3, 8], "dist": "normal", "log2": 0, "seed": 2},
                     "Wu": {"shape": [3, 8], "dist": "normal", "log2": 0, "seed": 3}}, "cancel": None}
    swapped = Fp8Products("numpy-fp8-swapped", FP8_FORMATS)
    swapped.gate_up = lambda Wg, Wu, x: FP8_DECLARED.gate_up(Wu, Wg, x)
    assert relation.check(swapped, held, "float64")
