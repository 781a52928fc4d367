"""A forward with one model-level mistake (tests/forward_mutants.py) fails the full-forward verdict.

The verdict compares each with the float64 reference and the plain same-dtype baseline, as the suite does.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.fixtures import checkpoint, generate
from gemma4_conformance.properties.forward import composed, judge_forward, reference
from tests.forward_mutants import MUTANTS, ForwardMutant

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
    verdict = judge_forward(candidate, baseline, ref, dtype)
    assert verdict.failures, (f"{mutant.name} passed in {dtype}: logits error {verdict.logits[0]:.3g} "
                              f"vs baseline {verdict.logits[1]:.3g}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_correct_wiring_passes(model, dtype):
    """The same machinery with no mistake passes, so the failures above come from the mistakes."""
    weights, tokens, ref = model
    candidate = composed(ForwardMutant("none"), weights.config, weights, tokens, dtype)
    baseline = composed(numpy_backend, weights.config, weights, tokens, dtype)
    assert not judge_forward(candidate, baseline, ref, dtype).failures
