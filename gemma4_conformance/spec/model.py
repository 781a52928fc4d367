"""The Gemma 4 text forward pass of ../shared/gemma-4-12B.md, built only from the spec's ops.

``forward`` is the compute graph; what it computes with is an *ops* object, whose
``op(node, op_name, *args)`` evaluates one op call of the graph, named by its *node*: ``OracleOps``
evaluates every op exactly with the mpmath oracles (the ground truth, affordable on tiny
geometries), and any other object with the same methods (a backend's ops in a dtype, an engine's
trace replayed node by node, a session's step) runs the same graph.

Nodes, in the order the graph computes them (``NODES``; the trace, the per-node verdicts and the
reports all use these names): ``embed``; per layer ``layers.{i}.{node}`` for each of
``LAYER_NODES`` (``v_proj`` on sliding layers only: a full layer's values are its keys, k = v);
then ``final_norm`` and ``logits``. ``layers.{i}.layer_scalar`` is the layer's output, the
residual stream that ``hidden_states[i]`` holds. Arrays are rows x features as in the contract; the
layer geometry comes from a ``TextConfig``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from . import ORACLES
from .exact import exact

VOCAB_CHUNK = 16384  # rows of the tied embedding in memory at once (240 MB in float32 at 12B)

# Each node of a layer and the op of the spec it is: name -> op.
LAYER_NODES: dict[str, str] = {
    "input_layernorm": "rmsnorm",
    "q_proj": "linear",
    "q_norm": "rmsnorm",
    "q_rope": "rope",
    "k_proj": "linear",
    "k_norm": "rmsnorm",
    "k_rope": "rope",
    "v_proj": "linear",
    "v_norm": "rmsnorm_unit",
    "attention": "sliding_gqa or causal_gqa",  # by the layer's kind
    "o_proj": "linear",
    "post_attention_layernorm": "rmsnorm",
    "attention_residual": "residual",
    "pre_feedforward_layernorm": "rmsnorm",
    "gate_up": "gate_up",
    "geglu": "gelu_mul",
    "down_proj": "linear",
    "post_feedforward_layernorm": "rmsnorm",
    "mlp_residual": "residual",
    "layer_scalar": "residual",  # x * s is residual(s, 0, x): the stream scaled by the stored scalar
}

# The ops the graph calls: an adapter needs all of them (or its own forward) to run the model.
OPS_USED = ("embed", "rmsnorm", "linear", "rope", "rmsnorm_unit", "sliding_gqa", "causal_gqa", "residual",
            "gate_up", "gelu_mul", "lm_head")


def layer_nodes(layer) -> dict[str, str]:
    """The nodes of one layer (``layers.{i}.{name}``) and their ops, in the order the graph computes them."""
    out = {}
    for name, op in LAYER_NODES.items():
        if name == "v_proj" and layer.k_eq_v:
            continue
        if name == "attention":
            op = "sliding_gqa" if layer.kind == "sliding" else "causal_gqa"
        out[f"layers.{layer.index}.{name}"] = op
    return out


def nodes(config) -> dict[str, str]:
    """Every node of the graph for ``config`` and its op, in the order the graph computes them."""
    out = {"embed": "embed"}
    for layer in config.layers:
        out.update(layer_nodes(layer))
    return out | {"final_norm": "rmsnorm", "logits": "lm_head"}


class OracleOps:
    """The spec's oracles as an ops object: weights taken exactly, every op exact to the working precision."""

    name = "oracle"

    def __init__(self, observe: Callable | None = None):
        self.observe = observe

    def op(self, node: str, name: str, *args):
        out = ORACLES[name](*args)
        if self.observe is not None:
            self.observe(node, name, args, out)
        return out

    def weight(self, array: np.ndarray):
        return exact(np.asarray(array))


def forward(ops, config, weights: Mapping[str, np.ndarray], tokens, positions=None, cache=None) -> dict:
    """Logits ``[T, V]`` and the residual stream after each layer (``hidden_states``, ``[T, H]`` each).

    1. x = embed(sqrt(hidden), E, tokens)
    2. per layer: attention block (q/k norms, RoPE, value norm, sliding or causal GQA, scale 1),
       post-attention norm and residual; MLP block (GeGLU), post-feedforward norm and residual;
       x = x * layer_scalar
    3. logits = lmHead(1, final softcap, E, rmsnorm(x, norm))

    ``tokens`` sit at ``positions`` (default 0..T-1, a whole prompt). With a ``cache`` (an object with
    ``attend(layer, positions, k, v) -> (keys, values, first)``: store this call's keys and values and
    return every key and value its queries may see, in position order, the first at position
    ``first``) the tokens continue a sequence whose earlier keys the cache holds: a prefill chunk or a
    decode step. The spec's attention ops place key l at position l, so the queries' positions are
    given relative to ``first``; their masks depend only on the difference.

    Weights are read from ``weights`` as each op needs them, so a lazily loaded checkpoint streams
    through one layer at a time.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    positions = np.arange(T) if positions is None else np.asarray(positions, dtype=np.int64)
    E = weights["model.embed_tokens.weight"]
    # embed(c, E, tokens) reads only the tokens' rows: pass those (the vocabulary is 262144 x 3840).
    rows, token_rows = np.unique(tokens, return_inverse=True)
    x = ops.op("embed", "embed", config.embed_scale, ops.weight(E[rows]), token_rows)
    hidden_states = []
    for layer in config.layers:
        x = decoder_layer(ops, config, weights, layer, x, positions, cache)
        hidden_states.append(x)
    return {"logits": head(ops, config, weights, x), "hidden_states": hidden_states}


def decoder_layer(ops, config, weights: Mapping[str, np.ndarray], layer, x, positions, cache=None):
    """One decoder layer of ``forward`` (step 2) on the residual stream ``x`` [T, H]: its output."""
    T = len(positions)
    eps, H = config.eps, config.num_heads
    node = f"layers.{layer.index}."

    def w(name):
        return ops.weight(weights[f"model.layers.{layer.index}.{name}"])

    D, Hkv = layer.head_dim, layer.kv_heads
    rope = (layer.rope_theta, layer.rope_rot, layer.rope_denom, layer.rope_active)
    h = ops.op(node + "input_layernorm", "rmsnorm", eps, x, w("input_layernorm.weight"))
    q = ops.op(node + "q_proj", "linear", w("self_attn.q_proj.weight"), h).reshape(T, H, D)
    q = ops.op(node + "q_norm", "rmsnorm", eps, q, w("self_attn.q_norm.weight"))
    q = ops.op(node + "q_rope", "rope", *rope, np.repeat(positions[:, None], H, 1), q)
    k_raw = ops.op(node + "k_proj", "linear", w("self_attn.k_proj.weight"), h).reshape(T, Hkv, D)
    if layer.k_eq_v:
        v_raw = k_raw
    else:
        v_raw = ops.op(node + "v_proj", "linear", w("self_attn.v_proj.weight"), h).reshape(T, Hkv, D)
    k = ops.op(node + "k_norm", "rmsnorm", eps, k_raw, w("self_attn.k_norm.weight"))
    k = ops.op(node + "k_rope", "rope", *rope, np.repeat(positions[:, None], Hkv, 1), k)
    v = ops.op(node + "v_norm", "rmsnorm_unit", eps, v_raw)
    keys, values, first = (k, v, 0) if cache is None else cache.attend(layer, positions, k, v)
    q = q.reshape(T, Hkv, H // Hkv, D)  # query head c*G + g reads KV head c
    if layer.kind == "sliding":
        attention = ops.op(node + "attention", "sliding_gqa", 1.0, layer.window, positions - first, q, keys, values)
    else:
        attention = ops.op(node + "attention", "causal_gqa", 1.0, positions - first, q, keys, values)
    o = ops.op(node + "o_proj", "linear", w("self_attn.o_proj.weight"), attention.reshape(T, H * D))
    o = ops.op(node + "post_attention_layernorm", "rmsnorm", eps, o, w("post_attention_layernorm.weight"))
    x = ops.op(node + "attention_residual", "residual", 1.0, x, o)
    m = ops.op(node + "pre_feedforward_layernorm", "rmsnorm", eps, x, w("pre_feedforward_layernorm.weight"))
    gu = ops.op(node + "gate_up", "gate_up", w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"), m)
    down = ops.op(node + "down_proj", "linear", w("mlp.down_proj.weight"), ops.op(node + "geglu", "gelu_mul", gu))
    down = ops.op(node + "post_feedforward_layernorm", "rmsnorm", eps, down, w("post_feedforward_layernorm.weight"))
    x = ops.op(node + "mlp_residual", "residual", 1.0, x, down)
    # The stored scalar is a bf16/fp16/fp32 value, which a Python float holds exactly.
    scalar = float(np.asarray(weights[f"model.layers.{layer.index}.layer_scalar"], dtype=np.float64).reshape(-1)[0])
    x = ops.op(node + "layer_scalar", "residual", scalar, np.zeros_like(x), x)
    return x


def head(ops, config, weights: Mapping[str, np.ndarray], x):
    """``forward``'s step 3 on the last layer's output ``x`` [T, H]: the logits [T, V]."""
    E = weights["model.embed_tokens.weight"]
    final = ops.op("final_norm", "rmsnorm", config.eps, x, ops.weight(weights["model.norm.weight"]))
    # Each logit depends on its own row of E: the LM head runs over the vocabulary in chunks, each a
    # call of the node "logits" for the next VOCAB_CHUNK columns.
    logits = [ops.op("logits", "lm_head", 1.0, config.final_softcap, ops.weight(E[start:start + VOCAB_CHUNK]), final)
              for start in range(0, E.shape[0], VOCAB_CHUNK)]
    return np.concatenate(logits, axis=-1)
