"""The reference forward: the pure mpmath graph end to end on a tiny geometry, and the float64 path
certified against it."""

from __future__ import annotations

import numpy as np

from gemma4_conformance import spec
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.properties.forward import reference
from gemma4_conformance.spec.model import OracleOps, forward


def tiny_config() -> dict:
    """Six layers (five sliding, one full, with keys = values and proportional RoPE), 16 query heads,
    a window of 4 that 6 tokens exceed: every feature of the real graph at a size mpmath affords."""
    d = generate.small_config()
    d.update({"num_hidden_layers": 6, "layer_types": d["layer_types"][:6], "hidden_size": 16,
              "intermediate_size": 16, "vocab_size": 32, "head_dim": 4, "global_head_dim": 8,
              "num_key_value_heads": 2, "sliding_window": 4})
    return d


def test_mpmath_forward_runs_end_to_end_and_agrees_with_the_float64_reference(tmp_path):
    weights = checkpoint.load(generate.write_checkpoint(tmp_path, tiny_config(), seed=3))
    tokens = np.array([1, 7, 3, 31, 0, 12])
    exact = forward(OracleOps(), weights.config, weights, tokens)
    fast, certificate = reference(weights.config, weights, tokens)
    assert not certificate.failures
    exact_logits = spec.round_to(exact["logits"], "float64")
    # The float64 path rounds ~ a few hundred times per output through 6 layers whose error growth
    # the generator keeps near 1: 1e-12 relative is thousands of float64 roundings of slack.
    scale = np.abs(exact_logits).max()
    assert np.abs(fast["logits"] - exact_logits).max() <= 1e-12 * scale
    for exact_layer, fast_layer in zip(exact["hidden_states"], fast["hidden_states"]):
        layer = spec.round_to(exact_layer, "float64")
        assert np.abs(fast_layer - layer).max() <= 1e-12 * np.abs(layer).max()
