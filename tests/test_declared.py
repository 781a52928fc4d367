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

from gemma4_conformance.adapters import declared_formats
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.checkpoints.quantized import rounded_activations
from gemma4_conformance.composition.graph import composed
from gemma4_conformance.plugin import EXIT_CONFORMANT, EXIT_NOT_CONFORMANT
from gemma4_conformance.properties import error_models
from gemma4_conformance.properties.forward import baseline_ops, drawn_tokens, judge_forward, local_errors, reference
from gemma4_conformance.properties.invariance import fixed
from gemma4_conformance.properties.judging import BeyondDeclared, assess, judge
from gemma4_conformance.properties.serving import Documents, normalize, run
from gemma4_conformance.properties.serving import judge as judge_schedule
from tests.quantized_engines import DECLARED, UNDECLARED
from tests.test_plugin import suite

TIGHT = 4  # the derived bound may be at most this many times the exact error on the worst draw


BLOCKS = {"q8_0": 32, "q8_k": 256}


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
    block = BLOCKS[name]

    def rounded(x):
        return rounded_activations(x, name)

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


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = generate.write_checkpoint(tmp_path_factory.mktemp("small"), generate.small_config(), seed=0)
    weights = checkpoint.load(path)
    tokens = drawn_tokens(weights.config.vocab_size, 24, 0)
    return weights, tokens, reference(weights.config, weights, tokens, certify=False)[0]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_forward_is_judged_against_a_baseline_that_rounds_as_the_engine_declares(small_model, dtype):
    """The forward's verdict is relative to a plain baseline: for an engine that declares its activations
    q8_0, the baseline rounds them so too (forward.baseline_ops), and the engine's forward passes; the same
    engine undeclared is judged against the plain baseline, which rounds nothing, and fails by the rounding
    (in float32 and float16, where it is far above the dtype's own)."""
    weights, tokens, ref = small_model
    failures = {}
    for engine in (DECLARED, UNDECLARED):
        candidate = composed(engine, weights.config, weights, tokens, dtype)
        plain = baseline_ops(declared_formats(engine))
        baseline = composed(plain, weights.config, weights, tokens, dtype)
        local = local_errors(candidate, weights.config, weights, tokens, dtype, plain)
        failures[engine.name] = judge_forward(candidate, baseline, ref, dtype, local).failures
    assert failures[DECLARED.name] == []
    assert any("own errors" in f for f in failures[UNDECLARED.name]), failures[UNDECLARED.name]


def test_a_session_is_judged_against_a_baseline_that_rounds_as_the_engine_declares(tmp_path):
    """The serving path's verdict has the forward's baseline: DECLARED's session passes a schedule judged with
    its declared formats and fails it judged without them."""
    path = generate.write_checkpoint(tmp_path, generate.small_config(), seed=0)
    documents = Documents(checkpoint.load(path), checkpoint=str(path))
    schedule = normalize(fixed(documents.window), documents.window)
    played = run(DECLARED, schedule, documents, "float32")
    assert judge_schedule(played, schedule, documents, "float32", declared_formats(DECLARED)).failures == []
    assert judge_schedule(played, schedule, documents, "float32").failures
