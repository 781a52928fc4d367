"""Examples at the real model's dimensions, checked in every run before any drawn example.

Drawn examples stay small so that Hypothesis can draw and shrink many of them, but kernels choose
their algorithm by size: split-K and blocked reductions at K = 3840 and 15360, tiled and online-
softmax attention over 4096 keys, a vocabulary processed in chunks.  So every accumulating op also
meets Gemma 4 12B's own geometry (read from its config, checkpoints/gemma-4-12B/config.json) once per
backend and dtype, with the oracle checking every output element:

* linear: a sliding layer's query projection (K = 3840, N = 4096) and 1024 rows of the down
  projection (K = 15360);
* gate_up: both halves at K = 3840, over 2048 of the intermediate width's 15360 rows;
* lm_head: a chunk of 2048 rows of the tied vocabulary at K = 3840, with the final softcap;
* rms and the norms: rows of the hidden width 3840;
* softmax: rows of 4096 logits;
* causal_gqa and decode_gqa: 4096 keys at the full layers' geometry (1 KV head, G = 16, D = 512);
  sliding_gqa: 4096 keys at the sliding layers' (8 KV heads, G = 2, D = 256, window 1024).

Output widths stay at a few thousand: the oracle checks every output, but building the inputs and the
error model cost about 0.1 us a weight in each dtype and backend, and accumulation depth, not width,
is what a kernel's size-dependent path changes.

Values are normal at a unit scale (a sum of 15360 products stays far inside float16's range), and q
and k at 2^-3 per coordinate, so that the logits' rounding in every dtype stays well inside the
region where attention is well posed (strategies.attention), with the model's scale 1.
"""

from __future__ import annotations

from functools import cache

from gemma4_conformance.checkpoints.config import TextConfig
from gemma4_conformance.checkpoints.generate import real_config
from gemma4_conformance.spec import CONTRACT

from .strategies import LONG_SUM

KEYS = LONG_SUM  # 4096 keys: a long context the oracle affords in every dtype
QUERY_ROWS = 4096  # a sliding layer's query projection: 16 heads of 256
DOWN_ROWS = 1024  # of the down projection's 3840
GATE_UP_ROWS = 2048  # of the intermediate width's 15360
VOCAB_CHUNK = 2048  # rows of the tied embedding in one LM-head example


@cache
def geometry() -> TextConfig:
    return TextConfig.from_dict(real_config(), source="checkpoints/gemma-4-12B/config.json")


def _normal(shape, seed, log2=0):
    return {"shape": list(shape), "dist": "normal", "log2": log2, "seed": seed}


def _attention(op, layer, seed=10):
    """q, k and v of one layer's geometry over KEYS keys; two prefill queries, in the middle and at the
    end, where the op takes positions (decode: its one query)."""
    config = geometry()
    Hkv, D = layer.kv_heads, layer.head_dim
    G = config.num_heads // Hkv
    names = CONTRACT[op].arg_names
    args = {"scale": 1.0, "k": _normal([KEYS, Hkv, D], seed + 1, -3), "v": _normal([KEYS, Hkv, D], seed + 2)}
    if "pos" not in names:
        args["q"] = _normal([Hkv, G, D], seed, -3)
    else:
        args |= {"pos": [KEYS // 2 - 1, KEYS - 1], "q": _normal([2, Hkv, G, D], seed, -3)}
    if "window" in names:
        args["window"] = layer.window
    return {"args": {name: args[name] for name in names}}


# Each op's cases at the real model's dimensions (none for the ops that do not accumulate).

def none(op: str) -> list[dict]:
    return []


def linear(op: str) -> list[dict]:
    H, I = geometry().hidden_size, geometry().intermediate_size
    return [{"args": {"W": _normal([QUERY_ROWS, H], 1), "x": _normal([2, H], 2)}, "cancel": None},
            {"args": {"W": _normal([DOWN_ROWS, I], 3), "x": _normal([2, I], 4)}, "cancel": None}]


def gate_up(op: str) -> list[dict]:
    H = geometry().hidden_size
    return [{"args": {"Wg": _normal([GATE_UP_ROWS, H], 5), "Wu": _normal([GATE_UP_ROWS, H], 6),
                      "x": _normal([2, H], 7)}, "cancel": None}]


def lm_head(op: str) -> list[dict]:
    config = geometry()
    H = config.hidden_size
    return [{"args": {"mul": 1.0, "cap": config.final_softcap, "W": _normal([VOCAB_CHUNK, H], 8),
                      "x": _normal([2, H], 9)}, "cancel": None}]


def norm(op: str) -> list[dict]:
    config = geometry()
    H = config.hidden_size
    shapes = {"x": [2, H], "z": [2, H], "w": [H]}
    floats = [a.name for a in CONTRACT[op].args if a.kind == "float"]
    return [{"args": {"eps": config.eps, **{n: _normal(shapes[n], 20 + i) for i, n in enumerate(floats)}}}]


def softmax(op: str) -> list[dict]:
    return [{"args": {"s": _normal([2, KEYS], 30, 2), "visible": {"pattern": "all", "seed": 0}}, "offset": 0.0}]


def full_attention(op: str) -> list[dict]:
    """At a full layer's geometry."""
    return [_attention(op, next(layer for layer in geometry().layers if layer.kind == "full"))]


def sliding_attention(op: str) -> list[dict]:
    """At a sliding layer's geometry, window included."""
    return [_attention(op, next(layer for layer in geometry().layers if layer.kind == "sliding"))]
