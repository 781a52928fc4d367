"""A forward with one model-level mistake (tests/forward_mutants.py) fails the full-forward verdict.

The verdict compares each with the float64 reference and the plain same-dtype baseline, as the suite does.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.composition.graph import composed
from gemma4_conformance.properties.forward import ACCUMULATED, FACTOR, judge_forward, local_errors, reference
from tests.forward_mutants import MUTANTS, QUANTIZED, ForwardMutant
from tests.quantized_engines import dequantized_wrongly

TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    weights = checkpoint.load(generate.write_checkpoint(tmp_path_factory.mktemp("small"), generate.small_config()))
    tokens = np.random.default_rng(0).integers(0, weights.config.vocab_size, TOKENS)
    ref, _ = reference(weights.config, weights, tokens, certify=False)
    return weights, tokens, ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_model_level_mistake_fails_the_forward_verdict(model, mutant, dtype):
    weights, tokens, ref = model
    candidate = composed(mutant, weights.config, weights, tokens, dtype)
    baseline = composed(numpy_backend, weights.config, weights, tokens, dtype)
    local = local_errors(candidate, weights.config, weights, tokens, dtype)
    verdict = judge_forward(candidate, baseline, ref, dtype, local)
    # Each mistake is found by the layers' or the head's own errors, where nothing compounds.
    assert any("own" in f for f in verdict.failures), (f"{mutant.name} passed in {dtype}: {verdict.failures}; "
                                                        f"logits error {verdict.logits[0]:.3g} vs baseline "
                                                        f"{verdict.logits[1]:.3g}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_correct_wiring_passes(model, dtype):
    """The same machinery with no mistake passes, so the failures above come from the mistakes."""
    weights, tokens, ref = model
    candidate = composed(ForwardMutant("none"), weights.config, weights, tokens, dtype)
    baseline = composed(numpy_backend, weights.config, weights, tokens, dtype)
    local = local_errors(candidate, weights.config, weights, tokens, dtype)
    assert not judge_forward(candidate, baseline, ref, dtype, local).failures
    assert all(ec == eb for ec, eb in local["layers"]) and local["logits"][0] == local["logits"][1]


def test_a_correct_engines_unlucky_draw_passes_on_its_own_errors_and_a_coherent_drift_fails():
    """Synthetic errors: an accumulated ratio above FACTOR passes when every layer's own error is
    within FACTOR (one draw's luck, as jax float32 on draw 3 measured); above ACCUMULATED it fails,
    and so does one layer's own error above FACTOR, whatever the accumulated ones."""
    rng = np.random.default_rng(0)
    ref = {"logits": rng.normal(size=(4, 50)), "hidden_states": [rng.normal(size=(4, 8)) for _ in range(3)]}

    def off(x, by):
        return x * (1 + by)

    def run(accumulated, own):
        baseline = {"logits": off(ref["logits"], 1e-3), "hidden_states": [off(h, 1e-3) for h in ref["hidden_states"]]}
        candidate = {"logits": off(ref["logits"], accumulated * 1e-3),
                     "hidden_states": [off(h, accumulated * 1e-3) for h in ref["hidden_states"]]}
        local = {"layers": [(own * 1e-3, 1e-3)] * 3, "logits": (1e-3, 1e-3), "logprob_gap": (1e-3, 1e-3)}
        return judge_forward(candidate, baseline, ref, "float32", local).failures

    assert not run(accumulated=FACTOR + 1, own=2.0)
    assert any("accumulated" in f for f in run(accumulated=ACCUMULATED + 1, own=2.0))
    assert any("own errors" in f for f in run(accumulated=1.0, own=FACTOR + 0.5))


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory):
    """The small model written in a weight format (each written once), with tokens and its reference."""
    models = {}

    def model(weight_format):
        if weight_format not in models:
            folder = generate.write_checkpoint(tmp_path_factory.mktemp(weight_format), generate.small_config(),
                                               weight_format=weight_format)
            weights = checkpoint.load(folder)
            tokens = np.random.default_rng(0).integers(0, weights.config.vocab_size, TOKENS)
            models[weight_format] = weights, tokens, reference(weights.config, weights, tokens, certify=False)[0]
        return models[weight_format]

    return model


def _verdict(engine, model, dtype="float32"):
    weights, tokens, ref = model
    candidate = composed(engine, weights.config, weights, tokens, dtype)
    baseline = composed(numpy_backend, weights.config, weights, tokens, dtype)
    return judge_forward(candidate, baseline, ref, dtype, local_errors(candidate, weights.config, weights, tokens, dtype))


@pytest.mark.parametrize("mutant, weight_format", QUANTIZED, ids=lambda m: getattr(m, "name", m))
def test_a_wrong_dequantization_of_the_checkpoint_s_blocks_fails_the_forward_verdict(quantized_models, mutant,
                                                                                   weight_format):
    verdict = _verdict(mutant, quantized_models(weight_format))
    assert any("own" in f for f in verdict.failures), f"{mutant.name} passed: {verdict.failures}"


@pytest.mark.parametrize("weight_format", sorted({f for _, f in QUANTIZED}))
def test_the_blocks_read_and_dequantized_right_pass(quantized_models, weight_format):
    """The control: the same engine with no mistake in its dequantization passes, so each mutant fails by its bug."""
    right = ForwardMutant("blocks_read_right", edit_weights=partial(dequantized_wrongly, lambda name, blocks: blocks))
    assert not _verdict(right, quantized_models(weight_format)).failures
