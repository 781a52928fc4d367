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


def test_the_reference_certifies_every_output_of_the_12b_geometrys_calls():
    """No sampler draws at forward.CERTIFY_WORK for the largest calls of the 12B forward (8 tokens): the
    down projection, a vocabulary chunk of the LM head, both halves of gate_up, attention over the
    full and sliding layers.  The samplers read only shapes, so the arguments are broadcast views."""
    from gemma4_conformance.properties.forward import CERTIFY_WORK
    from gemma4_conformance.properties.table import OPS
    from gemma4_conformance.spec.model import VOCAB_CHUNK

    def shaped(*shape):
        return np.broadcast_to(np.float64(1.0), shape)

    T, H, I = 8, 3840, 15360
    calls = {"linear": (shaped(H, I), shaped(T, I)), "gate_up": (shaped(I, H), shaped(I, H), shaped(T, H)),
             "lm_head": (1.0, 30.0, shaped(VOCAB_CHUNK, H), shaped(T, H)),
             "causal_gqa": (1.0, np.arange(T), shaped(T, 1, 16, 512), shaped(T, 1, 512), shaped(T, 1, 512)),
             "sliding_gqa": (1.0, 1024, np.arange(T), shaped(T, 8, 2, 256), shaped(T, 8, 256), shaped(T, 8, 256)),
             "rmsnorm": (1e-6, shaped(T, H), shaped(H)), "gelu_mul": (shaped(T, 2 * I),)}
    for op, args in calls.items():
        _, index = OPS[op].sample(op, args, np.random.default_rng(0), CERTIFY_WORK)
        assert index[0] is Ellipsis, f"{op}'s call is sampled"


def test_a_long_sequences_reference_certifies_every_op_the_sequence_ones_whole(tmp_path):
    """A long session's reference (the slow serving test's) certifies rope's and attention's calls whole and
    every other op's on the outputs the op tests' sampler draws: every op of the graph, and at the 12B
    geometry's 1036 tokens a per-token op's call is sampled."""
    from gemma4_conformance.properties.forward import LONG_CONTEXT_OPS, SAMPLED_WORK, Certificate
    from gemma4_conformance.properties.table import OPS
    from gemma4_conformance.composition.graph import AdapterOps
    from gemma4_conformance.adapters import numpy_backend

    weights = checkpoint.load(generate.write_checkpoint(tmp_path, tiny_config(), seed=3))
    tokens = np.arange(12) % weights.config.vocab_size
    called, certificate = set(), Certificate(ops=LONG_CONTEXT_OPS, sampled=True)

    def observe(node, op, args, out):
        called.add(op)
        certificate(node, op, args, out)

    forward(AdapterOps(numpy_backend, "float64", observe=observe), weights.config, weights, tokens)
    assert certificate.certified == called and LONG_CONTEXT_OPS <= called and len(called) > len(LONG_CONTEXT_OPS)
    assert not certificate.failures
    whole = Certificate(ops=LONG_CONTEXT_OPS)
    forward(AdapterOps(numpy_backend, "float64", observe=whole), weights.config, weights, tokens)
    assert whole.certified == LONG_CONTEXT_OPS & called  # without sampled, the others are left out
    down = (np.broadcast_to(1.0, (3840, 15360)), np.broadcast_to(1.0, (1036, 15360)))
    _, index = OPS["linear"].sample("linear", down, np.random.default_rng(0), SAMPLED_WORK)
    assert index[0] is not Ellipsis
    # A sampled call still fails the certificate where the reference is wrong: a norm off by 1%, everywhere.
    x, w = np.random.default_rng(1).standard_normal((1036, 3840)), np.ones(3840)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    wrong = Certificate(ops=LONG_CONTEXT_OPS, sampled=True)
    wrong("layers.0.input_norm", "rmsnorm", (1e-6, x, w), normed * 1.01)
    assert wrong.checked < wrong.outputs and wrong.failures
