"""Engines for the trace tests: the spec's graph composed from ops with one wrong op, or one wrong node.

``small_model`` is the generated checkpoint cut to 12 layers (two full ones: every feature of the
geometry, a quarter of the nodes to judge) with 24 tokens, past the sliding window of 8.
"""

from __future__ import annotations

import numpy as np

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.composition.graph import AdapterOps, TraceRecorder
from gemma4_conformance.properties.forward import reference
from gemma4_conformance.spec.model import forward
from tests.mutants import BF16, MutantAdapter, _engine, _round, sliding_gqa_window_edge_off_by_one

LAYERS = 12
TOKENS = 24


def small_model(folder):
    """(weights, tokens, float64 reference) of the 12-layer cut of the generated model."""
    config = generate.small_config()
    config.update(num_hidden_layers=LAYERS, layer_types=config["layer_types"][:LAYERS])
    weights = checkpoint.load(generate.write_checkpoint(folder, config))
    tokens = np.random.default_rng(0).integers(0, weights.config.vocab_size, TOKENS)
    ref, _ = reference(weights.config, weights, tokens, certify=False)
    return weights, tokens, ref


@_engine("rmsnorm")
def rmsnorm_bf16_accumulation(eps, x, w):
    """The squares and their running sum rounded to bf16, as a bf16 engine without an fp32 accumulator."""
    total = np.zeros(x.shape[:-1] + (1,), dtype=np.float32)
    for k in range(x.shape[-1]):
        total = _round(total + _round(x[..., k:k + 1] * x[..., k:k + 1], BF16), BF16)
    return x / np.sqrt(total / x.shape[-1] + eps) * w


def rmsnorm_eps_ignored(eps, x, w):
    return numpy_backend.rmsnorm(0.0, x, w)


# (engine, dtype, rms_norm_eps or None for the model's, the node that must depart first, its op)
WRONG_OPS = [
    (MutantAdapter("rmsnorm", rmsnorm_bf16_accumulation), "bfloat16", None, "layers.0.input_layernorm", "rmsnorm"),
    # eps 1e-6 is below a float32 ULP of the mean square wherever the stream is O(1); 1e-3 is where eps matters
    (MutantAdapter("rmsnorm", rmsnorm_eps_ignored), "float32", 1e-3, "layers.0.input_layernorm", "rmsnorm"),
    (MutantAdapter("sliding_gqa", sliding_gqa_window_edge_off_by_one), "bfloat16", None, "layers.0.attention",
     "sliding_gqa"),
]


class OneWrongNode:
    """The numpy ops, except that node ``node`` computes ``op`` with ``implementation``; records the trace."""

    def __init__(self, node, implementation):
        self.node, self.implementation = node, implementation

    def run(self, config, weights, tokens, dtype):
        recorder = TraceRecorder()
        ops = AdapterOps(numpy_backend, dtype, observe=recorder)
        plain = ops.op

        def op(node, name, *args):
            if node != self.node:
                return plain(node, name, *args)
            out = self.implementation(*args)
            recorder(node, name, args, out)
            return out

        ops.op = op
        return {**forward(ops, config, weights, tokens), "trace": recorder.trace}
