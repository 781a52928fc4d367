"""The Gemma 4 text forward pass of ../shared/gemma-4-12B.md, built only from the spec's ops.

``forward`` is the compute graph; what it computes with is an *ops* object: ``OracleOps`` evaluates
every op exactly with the mpmath oracles (the ground truth, affordable on tiny geometries), and any
other object with the same methods (a backend adapter in a dtype, for one) runs the same graph.
Arrays are rows x features as in the contract; the layer geometry comes from a ``TextConfig``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from mpmath import mp, mpf

from . import ORACLES
from .exact import exact, get_precision

VOCAB_CHUNK = 16384  # rows of the tied embedding in memory at once (240 MB in float32 at 12B)

# The ops the graph calls: an adapter needs all of them (or its own forward) to run the model.
OPS_USED = ("embed", "rmsnorm", "linear", "rope", "rmsnorm_unit", "sliding_gqa", "causal_gqa", "residual",
            "gate_up", "gelu_mul", "lm_head")


class OracleOps:
    """The spec's oracles as an ops object: weights taken exactly, every op exact to the working precision."""

    name = "oracle"

    def __init__(self, observe: Callable | None = None):
        self.observe = observe

    def op(self, name: str, *args):
        out = ORACLES[name](*args)
        if self.observe is not None:
            self.observe(name, args, out)
        return out

    def weight(self, array: np.ndarray):
        return exact(np.asarray(array))

    def scale(self, x, s):
        """x * s for a stored per-layer scalar (exact products at the working precision)."""
        with mp.workprec(get_precision()):
            return x * mpf(float(np.asarray(s, dtype=np.float64).reshape(-1)[0]))


def forward(ops, config, weights: Mapping[str, np.ndarray], tokens, observe_layer: Callable | None = None) -> dict:
    """Logits ``[T, V]`` and the residual stream after each layer (``hidden_states``, ``[T, H]`` each).

    1. x = embed(sqrt(hidden), E, tokens)
    2. per layer: attention block (q/k norms, RoPE, value norm, sliding or causal GQA, scale 1),
       post-attention norm and residual; MLP block (GeGLU), post-feedforward norm and residual;
       x = x * layer_scalar
    3. logits = lmHead(1, final softcap, E, rmsnorm(x, norm))

    Weights are read from ``weights`` as each op needs them, so a lazily loaded checkpoint streams
    through one layer at a time.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    eps, H = config.eps, config.num_heads
    positions = np.arange(T)
    E = weights["model.embed_tokens.weight"]
    # embed(c, E, tokens) reads only the tokens' rows: pass those (the vocabulary is 262144 x 3840).
    rows, token_rows = np.unique(tokens, return_inverse=True)
    x = ops.op("embed", config.embed_scale, ops.weight(E[rows]), token_rows)
    hidden_states = []
    for layer in config.layers:
        def w(name, prefix=f"model.layers.{layer.index}."):
            return ops.weight(weights[prefix + name])

        D, Hkv = layer.head_dim, layer.kv_heads
        rope = (layer.rope_theta, layer.rope_rot, layer.rope_denom, layer.rope_active)
        h = ops.op("rmsnorm", eps, x, w("input_layernorm.weight"))
        q = ops.op("linear", w("self_attn.q_proj.weight"), h).reshape(T, H, D)
        q = ops.op("rope", *rope, np.repeat(positions[:, None], H, 1), ops.op("rmsnorm", eps, q, w("self_attn.q_norm.weight")))
        k_raw = ops.op("linear", w("self_attn.k_proj.weight"), h).reshape(T, Hkv, D)
        v_raw = k_raw if layer.k_eq_v else ops.op("linear", w("self_attn.v_proj.weight"), h).reshape(T, Hkv, D)
        k = ops.op("rope", *rope, np.repeat(positions[:, None], Hkv, 1), ops.op("rmsnorm", eps, k_raw, w("self_attn.k_norm.weight")))
        v = ops.op("rmsnorm_unit", eps, v_raw)
        q = q.reshape(T, Hkv, H // Hkv, D)  # query head c*G + g reads KV head c
        if layer.kind == "sliding":
            attention = ops.op("sliding_gqa", 1.0, layer.window, positions, q, k, v)
        else:
            attention = ops.op("causal_gqa", 1.0, positions, q, k, v)
        o = ops.op("linear", w("self_attn.o_proj.weight"), attention.reshape(T, H * D))
        x = ops.op("residual", 1.0, x, ops.op("rmsnorm", eps, o, w("post_attention_layernorm.weight")))
        m = ops.op("rmsnorm", eps, x, w("pre_feedforward_layernorm.weight"))
        gu = ops.op("gate_up", w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"), m)
        down = ops.op("linear", w("mlp.down_proj.weight"), ops.op("gelu_mul", gu))
        x = ops.op("residual", 1.0, x, ops.op("rmsnorm", eps, down, w("post_feedforward_layernorm.weight")))
        x = ops.scale(x, weights[f"model.layers.{layer.index}.layer_scalar"])
        hidden_states.append(x)
        if observe_layer is not None:
            observe_layer(layer.index, x)
    final = ops.op("rmsnorm", eps, x, ops.weight(weights["model.norm.weight"]))
    # Each logit depends on its own row of E: the LM head runs over the vocabulary in chunks.
    logits = [ops.op("lm_head", 1.0, config.final_softcap, ops.weight(E[start:start + VOCAB_CHUNK]), final)
              for start in range(0, E.shape[0], VOCAB_CHUNK)]
    return {"logits": np.concatenate(logits, axis=-1), "hidden_states": hidden_states}
