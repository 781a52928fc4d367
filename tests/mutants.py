"""Deliberately wrong backends: the numpy reference with one op replaced by a realistic bug.

Each mutant is a function with the op's signature, named by what it gets wrong.  Most compute the
way the reference does (floating arguments widened to float32, float64 kept, one rounding to the
dtype at the end) so that the bug is the only difference; the accumulation and angle mutants round
where a careless engine rounds.  ``MutantAdapter`` turns one into a backend; test_mutants.py holds
the table of which mutant runs in which dtype.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from gemma4_conformance.adapters import numpy_backend as reference
from gemma4_conformance.checkpoints.quantized import rounded_activations
from gemma4_conformance.spec import CONTRACT, format_of
from tests.quantized_engines import FP8_FORMATS, FP8_STATIC, KV_DECLARED, KvCacheInFp8

BF16 = np.dtype(ml_dtypes.bfloat16)


class MutantAdapter:
    """The reference backend with ``op`` replaced by ``implementation``; every other op delegates."""

    def __init__(self, op: str, implementation, base=reference):
        self._base = base
        self.name = f"{base.name} with {implementation.__name__}"
        self.dtypes = base.dtypes
        if hasattr(implementation, "formats"):  # a mutant that declares formats, judged given them
            self.formats = implementation.formats
        setattr(self, op, implementation)

    def __getattr__(self, attribute):
        return getattr(self._base, attribute)


def _engine(op: str):
    """Run ``fn`` as the reference runs an op: floating arguments in float32 (float64 stays float64),
    the result rounded once to the dtype under test.  numpy's warnings are silenced: overflow and 0/0
    are what some mutants do wrong."""
    kinds = [a.kind for a in CONTRACT[op].args]

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args):
            dtype = next(a.dtype for a, kind in zip(args, kinds) if kind == "float")
            wide = np.float64 if dtype == np.float64 else np.float32
            args = [np.asarray(a).astype(wide) if kind == "float" else a for a, kind in zip(args, kinds)]
            with np.errstate(all="ignore"):
                return np.asarray(fn(*args)).astype(dtype)

        return run

    return wrap


def _engine_inv_freq(fn):
    """inv_freq's variant of ``_engine``: no floating argument, the dtype passed by name."""

    @functools.wraps(fn)
    def run(theta, denom, active, i, dtype):
        wide = np.float64 if dtype == "float64" else np.float32
        return np.asarray(fn(wide(theta), denom, active, np.asarray(i).astype(wide))).astype(format_of(dtype).dtype)

    return run


def _round(a, dtype) -> np.ndarray:
    """``a`` rounded to ``dtype`` and widened back to float32, as a narrow intermediate."""
    return np.asarray(a).astype(dtype).astype(np.float32)


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _swap_halves(gu):
    gate, up = np.split(gu, 2, axis=-1)
    return np.concatenate([up, gate], axis=-1)


# Basic


@_engine("sigmoid")
def sigmoid_tanh_form_without_half_angle(x):
    return 0.5 * (1 + np.tanh(x))  # sigmoid(x) = (1 + tanh(x / 2)) / 2


@_engine("sigmoid")
def sigmoid_tanh_form_sign_flipped(x):
    return 0.5 * (1 - np.tanh(x / 2))


@_engine("silu")
def silu_as_quick_gelu(x):
    return x / (1 + np.exp(-1.702 * x))  # x sigmoid(1.702 x): the quick-GELU constant


@_engine("gelu_tanh")
def gelu_tanh_as_erf_gelu(x):
    return x / 2 * (1 + _erf(x.astype(np.float64) / math.sqrt(2)))


@_engine("softcap")
def softcap_outer_multiply_missing(c, x):
    return np.tanh(x / c)


# Norm


def rms_eps_missing(eps, x):
    return reference.rms(0.0, x)


@_engine("rms")
def rms_bf16_accumulation(eps, x):
    """The squares and their running sum rounded to bf16, as a bf16 engine without an fp32 accumulator."""
    total = np.zeros(x.shape[:-1], dtype=np.float32)
    for k in range(x.shape[-1]):
        total = _round(total + _round(x[..., k] * x[..., k], BF16), BF16)
    return np.sqrt(total / x.shape[-1] + eps)


def rmsnorm_weight_as_one_plus_w(eps, x, w):
    return reference.rmsnorm_offset(eps, x, w)


def rmsnorm_eps_missing(eps, x, w):
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero row divides 0 by 0
        return reference.rmsnorm(0.0, x, w)


def rmsnorm_offset_weight_as_w(eps, x, w):
    return reference.rmsnorm(eps, x, w)


@_engine("rmsnorm_unit")
def rmsnorm_unit_eps_outside_sqrt(eps, x):
    return x / (np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) + eps)


@_engine("rmsnorm_gated")
def rmsnorm_gated_gate_before_norm(eps, x, z, w):
    """norm(x silu(z)) w instead of norm(x) w silu(z): the other setting of a gated norm."""
    gated = x * z / (1 + np.exp(-z))
    return gated / np.sqrt(np.mean(gated * gated, axis=-1, keepdims=True) + eps) * w


@_engine("l2norm")
def l2norm_eps_as_clamp(eps, x):
    """x / max(|x|, eps), torch's F.normalize, instead of x / sqrt(|x|^2 + eps)."""
    return x / np.maximum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), eps)


# Rope


@_engine_inv_freq
def inv_freq_active_ignored(theta, denom, active, i):
    """Every frequency kept: partial RoPE's inactive pairs rotate instead of passing through."""
    return theta ** (-2 * i / denom)


@_engine_inv_freq
def inv_freq_index_not_doubled(theta, denom, active, i):
    """theta^(-i / denom): the exponent over arange(0, rot // 2) where arange(0, rot, 2) belongs."""
    return np.where(i < active, theta ** (-i / denom), 0)


def _inv_freq(theta, denom, active, half):
    """The reference's inverse frequencies [half], in float32."""
    i = np.arange(half)
    return np.where(i < active, np.float32(theta) ** ((-2 * i).astype(np.float32) / np.float32(denom)), 0)


def _angles(theta, denom, active, pos, half, angle_dtype):
    """pos * inv_freq [..., half], with the inverse frequencies, the positions and their product
    rounded to ``angle_dtype`` (float32: the reference's angles)."""
    freq = _inv_freq(theta, denom, active, half)
    return _round(_round(pos[..., None], angle_dtype) * _round(freq, angle_dtype), angle_dtype)


def _rotate(x, angle, rot, interleaved):
    """x rotated by ``angle`` [..., rot // 2] in the pairs (i, i + half), or (2i, 2i + 1) if interleaved."""
    half = rot // 2
    first = np.arange(0, 2 * half, 2) if interleaved else np.arange(half)
    second = first + 1 if interleaved else first + half
    cos, sin = np.cos(angle), np.sin(angle)
    out = x.copy()
    out[..., first] = x[..., first] * cos - x[..., second] * sin
    out[..., second] = x[..., second] * cos + x[..., first] * sin
    return out


@_engine("rope")
def rope_pairs_interleaved(theta, rot, denom, active, pos, x):
    return _rotate(x, _angles(theta, denom, active, pos, rot // 2, np.float32), rot, interleaved=True)


@_engine("rope")
def rope_denom_replaced_by_rot(theta, rot, denom, active, pos, x):
    """Partial RoPE's frequencies computed over the rotated width instead of the head dimension."""
    return _rotate(x, _angles(theta, rot, active, pos, rot // 2, np.float32), rot, interleaved=False)


@_engine("rope")
def rope_angles_in_bf16(theta, rot, denom, active, pos, x):
    return _rotate(x, _angles(theta, denom, active, pos, rot // 2, BF16), rot, interleaved=False)


@_engine("rope")
def rope_angles_in_fp16(theta, rot, denom, active, pos, x):
    return _rotate(x, _angles(theta, denom, active, pos, rot // 2, np.float16), rot, interleaved=False)


@_engine("rope_std")
def rope_std_pairs_interleaved(theta, rot, pos, x):
    return _rotate(x, _angles(theta, rot, rot // 2, pos, rot // 2, np.float32), rot, interleaved=True)


@_engine("rope_std")
def rope_std_inv_freq_buffer_in_bf16(theta, rot, pos, x):
    """Angles in float32 from an inverse-frequency buffer cast to bf16 along with the weights."""
    freq = _round(_inv_freq(theta, rot, rot // 2, rot // 2), BF16)
    return _rotate(x, pos[..., None].astype(np.float32) * freq, rot, interleaved=False)


@_engine("rope_std")
def rope_std_rotation_reversed(theta, rot, pos, x):
    return _rotate(x, -_angles(theta, rot, rot // 2, pos, rot // 2, np.float32), rot, interleaved=False)


# Linear


def _bf16_dot(W, x):
    """x @ W.T with each product exact in float32 and the running sum rounded to bf16 after every add."""
    total = np.zeros(x.shape[:-1] + W.shape[:1], dtype=np.float32)
    for k in range(x.shape[-1]):
        total = _round(total + x[..., k, None] * W[:, k], BF16)
    return total


@_engine("linear")
def linear_bf16_accumulation(W, x):
    return _bf16_dot(W, x)


def linear_activations_in_q8_0_undeclared(W, x):
    """llama.cpp's CPU path without its declaration: x rounded to q8_0 blocks before the product
    (tests/quantized_engines.py; declared, the same engine is conformant)."""
    return reference.linear(W, rounded_activations(x, "q8_0"))


causal_gqa_fp8_cache_read_without_its_scale = KvCacheInFp8(
    "numpy-kv-fp8_e4m3-read-without-scale", KV_DECLARED.formats["kv_cache"], declare=True,
    read=lambda stored, scale, dtype: stored.astype(dtype)).causal_gqa
causal_gqa_fp8_cache_read_without_its_scale.__name__ = "causal_gqa_fp8_cache_read_without_its_scale"
causal_gqa_fp8_cache_read_without_its_scale.__doc__ = (
    "An fp8 KV cache that stores fp8(x / scale) and reads the fp8 values back without multiplying by the "
    "scale, declaring fp8_e4m3 with its scales as KV_DECLARED does (tests/quantized_engines.py). A cache "
    "that drops the scale on both sides is no mutant: in the format's normal range its values are within "
    "the declared rounding's bound, and with a power-of-two scale the same.")


def linear_fp8_static_scale_saturating(W, x):
    """fp8 products (x per token, W per channel in e4m3) declared with dynamic scales, but x's scale a
    fixed calibration (1/448, for |x| <= 1), as a static fp8 checkpoint's input scale: every value past it
    saturates at 448 s (tests/quantized_engines.py; with dynamic scales the same engine is conformant)."""
    return FP8_STATIC.linear(W, x)


linear_fp8_static_scale_saturating.formats = FP8_FORMATS


def gate_up_gate_and_up_swapped(Wg, Wu, x):
    return reference.gate_up(Wu, Wg, x)


def silu_mul_gate_and_up_swapped(gu):
    return reference.silu_mul(_swap_halves(gu))


def gelu_mul_gate_and_up_swapped(gu):
    return reference.gelu_mul(_swap_halves(gu))


@_engine("gelu_mul")
def gelu_mul_erf_gelu(gu):
    gate, up = np.split(gu, 2, axis=-1)
    return gate / 2 * (1 + _erf(gate.astype(np.float64) / math.sqrt(2))) * up


def residual_r_ignored(r, x, h):
    return reference.residual(1.0, x, h)


def embed_multiplier_missing(c, E, tokens):
    return reference.embed(1.0, E, tokens)


def embed_multiplier_rounded_to_bf16(c, E, tokens):
    """c rounded to bf16 (sqrt(3840) -> 62.0) in an engine that computes in float32."""
    return reference.embed(float(np.float32(c).astype(BF16)), E, tokens)


@_engine("lm_head")
def lm_head_softcap_before_multiplier(mul, cap, W, x):
    logits = x @ W.T
    return mul * (logits if cap is None else cap * np.tanh(logits / cap))


@_engine("lm_head")
def lm_head_bf16_accumulation(mul, cap, W, x):
    logits = mul * _bf16_dot(W, x)
    return logits if cap is None else cap * np.tanh(logits / cap)


# Attention


def _softmax(s, visible):
    """The reference softmax in float32: max over the visible entries subtracted, masked entries 0."""
    m = np.max(s, axis=-1, keepdims=True, where=visible, initial=-np.inf)
    e = np.where(visible, np.exp(s - m), 0)
    total = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1)


@_engine("softmax")
def softmax_max_not_subtracted(s, visible):
    e = np.where(visible, np.exp(s), 0)
    return e / np.sum(e, axis=-1, keepdims=True)


@_engine("softmax")
def softmax_bf16_sum(s, visible):
    """exp(s - max) in bf16 and summed in bf16 (the running sum rounded after every add)."""
    m = np.max(s, axis=-1, keepdims=True, where=visible, initial=-np.inf)
    e = _round(np.where(visible, np.exp(s - m), 0), BF16)
    total = np.zeros(s.shape[:-1] + (1,), dtype=np.float32)
    for l in range(s.shape[-1]):
        total = _round(total + e[..., l : l + 1], BF16)
    return e / np.where(total > 0, total, 1)


def _gqa(scale, visible, q, k, v, interleaved=False):
    """q [S, Hkv, G, D], k, v [L, Hkv, D], visible [S, L].  Query head h = c G + g reads KV head
    h // G = c; ``interleaved`` reads h % Hkv instead (a repeat where repeat_interleave belongs)."""
    S, Hkv, G, D = q.shape
    heads = np.arange(Hkv * G)
    kv_head = heads % Hkv if interleaved else heads // G
    logits = scale * np.einsum("shd,lhd->shl", q.reshape(S, Hkv * G, D), k[:, kv_head])
    p = _softmax(logits, visible[:, None, :])
    return np.einsum("shl,lhd->shd", p, v[:, kv_head]).reshape(S, Hkv, G, D)


@_engine("causal_gqa")
def causal_gqa_mask_edge_off_by_one(scale, pos, q, k, v):
    l = np.arange(k.shape[0])
    return _gqa(scale, l < pos[:, None], q, k, v)  # a query must see its own key: l <= pos


@_engine("causal_gqa")
def causal_gqa_bf16_value_accumulation(scale, pos, q, k, v):
    """softmax(q.k) @ v with the weights in bf16 and the running sum over keys rounded to bf16."""
    S, Hkv, G, D = q.shape
    l = np.arange(k.shape[0])
    logits = scale * np.einsum("scgd,lcd->scgl", q, k)
    p = _round(_softmax(logits, (l <= pos[:, None])[:, None, None, :]), BF16)
    total = np.zeros(q.shape, dtype=np.float32)
    for key in range(k.shape[0]):
        total = _round(total + p[..., key, None] * v[key][None, :, None, :], BF16)
    return total


@_engine("causal_gqa")
def causal_gqa_heads_interleaved(scale, pos, q, k, v):
    l = np.arange(k.shape[0])
    return _gqa(scale, l <= pos[:, None], q, k, v, interleaved=True)


@_engine("sliding_gqa")
def sliding_gqa_window_edge_off_by_one(scale, window, pos, q, k, v):
    l, p = np.arange(k.shape[0]), pos[:, None]
    return _gqa(scale, (l <= p) & (p - l <= window), q, k, v)  # the window holds pos - l < window


@_engine("sliding_gqa")
def sliding_gqa_heads_interleaved(scale, window, pos, q, k, v):
    l, p = np.arange(k.shape[0]), pos[:, None]
    return _gqa(scale, (l <= p) & (p - l < window), q, k, v, interleaved=True)


@_engine("decode_gqa")
def decode_gqa_heads_interleaved(scale, q, k, v):
    return _gqa(scale, np.ones((1, k.shape[0]), dtype=bool), q[None], k, v, interleaved=True)[0]


@_engine("decode_gqa")
def decode_gqa_newest_key_masked(scale, q, k, v):
    visible = np.arange(k.shape[0])[None, :] < k.shape[0] - 1  # the query's own key is its newest
    return _gqa(scale, visible, q[None], k, v)[0]


def _attention_args(op, args):
    """(scale, visible [S, L], q [S, Hkv, G, D], k, v) of an attention op's arguments."""
    from gemma4_conformance.properties.table import OPS
    return OPS[op].attention(args)


def _attention_mutant(op, name, body):
    """``body(scale, visible, q, k, v)`` -> [S, Hkv, G, D] as the op ``op`` (decode: its one query)."""
    def run(*args):
        scale, visible, q, k, v = _attention_args(op, args)
        dtype = q.dtype
        wide = np.float64 if dtype == np.float64 else np.float32
        with np.errstate(all="ignore"):
            out = np.asarray(body(scale, visible, q.astype(wide), k.astype(wide), v.astype(wide))).astype(dtype)
        return out[0] if op == "decode_gqa" else out

    run.__name__ = f"{op}_{name}"
    return run


def _zeros(scale, visible, q, k, v):
    return np.zeros_like(q)


def _uniform_weights(scale, visible, q, k, v):
    """The average of the visible values: q.k ignored."""
    counts = np.maximum(visible.sum(-1), 1)[:, None, None]
    mean = np.einsum("sl,lcd->scd", visible.astype(q.dtype), v) / counts
    return np.broadcast_to(mean[:, :, None, :], q.shape)


def _last_head_zeroed(scale, visible, q, k, v):
    out = _gqa(scale, visible, q, k, v).copy()
    out[:, -1, -1] = 0  # query head Hkv * G - 1
    return out


def _running_max_from_zero(scale, visible, q, k, v, tile=64):
    """An online softmax over tiles of 64 keys whose running maximum starts at 0 instead of -inf: rows
    whose visible logits all lie far below 0 underflow exp and come out 0 (or 0/0)."""
    S, Hkv, G, D = q.shape
    logits = scale * np.einsum("scgd,lcd->scgl", q, k)
    mask = visible[:, None, None, :]
    running = np.zeros(logits.shape[:-1], dtype=q.dtype)
    total = np.zeros_like(running)
    acc = np.zeros(q.shape, dtype=q.dtype)
    for start in range(0, k.shape[0], tile):
        block = np.where(mask[..., start:start + tile], logits[..., start:start + tile], -np.inf)
        new = np.maximum(running, block.max(-1, initial=-np.inf))
        rescale, e = np.exp(running - new), np.exp(block - new[..., None])
        total = total * rescale + e.sum(-1)
        acc = acc * rescale[..., None] + np.einsum("scgl,lcd->scgd", e, v[start:start + tile])
        running = new
    return acc / np.where(total > 0, total, np.inf)[..., None]


@_engine("rmsnorm")
def rmsnorm_squares_in_float16(eps, x, w):
    """x^2 and its mean computed in float16, the dtype of the weights, where x^2 overflows at |x| > 256."""
    x16 = x.astype(np.float16)
    mean = np.mean((x16 * x16).astype(np.float16), axis=-1, keepdims=True, dtype=np.float16).astype(np.float32)
    return x / np.sqrt(mean + eps) * w


@_engine("gelu_tanh")
def gelu_tanh_tanh_rounded_to_dtype(x):
    """tanh t rounded to bfloat16 before 1 + tanh t, as per-op bf16 JAX does: the tail cancels to 0."""
    t = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    return x / 2 * (1 + _round(np.tanh(t), BF16))


def sigmoid_gate_operands_swapped(o, gate):
    return reference.sigmoid_gate(gate, o)


@_engine("sigmoid_gate")
def sigmoid_gate_silu_instead_of_sigmoid(o, gate):
    return o * gate / (1 + np.exp(-gate))


# Contract breakers: a right answer in the wrong form, or none


def linear_raises(W, x):
    raise RuntimeError("no kernel for this shape")


def linear_transposed(W, x):
    return reference.linear(W, x).T  # W x^T where x W^T belongs: [N, ...] instead of [..., N]


def linear_left_in_float32(W, x):
    return reference.linear(W.astype(np.float32), x.astype(np.float32))  # never cast back


# Which mutant runs in which dtype: the dtype where its bug is a real bug.
MUTANTS = [  # (op, dtype, mutant)
    ("sigmoid", "float32", sigmoid_tanh_form_without_half_angle),
    ("sigmoid", "bfloat16", sigmoid_tanh_form_sign_flipped),
    ("silu", "float32", silu_as_quick_gelu),
    ("gelu_tanh", "float32", gelu_tanh_as_erf_gelu),
    ("softcap", "float32", softcap_outer_multiply_missing),
    ("rms", "float32", rms_eps_missing),
    ("rms", "bfloat16", rms_bf16_accumulation),
    ("rmsnorm", "float32", rmsnorm_weight_as_one_plus_w),
    ("rmsnorm", "float32", rmsnorm_eps_missing),
    ("rmsnorm", "bfloat16", rmsnorm_eps_missing),
    ("rmsnorm_offset", "bfloat16", rmsnorm_offset_weight_as_w),
    ("rmsnorm_unit", "float32", rmsnorm_unit_eps_outside_sqrt),
    ("rmsnorm_gated", "float32", rmsnorm_gated_gate_before_norm),
    ("l2norm", "float32", l2norm_eps_as_clamp),
    ("inv_freq", "float32", inv_freq_active_ignored),
    ("inv_freq", "float32", inv_freq_index_not_doubled),
    ("rope", "float32", rope_pairs_interleaved),
    ("rope", "float32", rope_denom_replaced_by_rot),
    ("rope", "bfloat16", rope_angles_in_bf16),
    ("rope", "bfloat16", rope_angles_in_fp16),
    ("rope_std", "bfloat16", rope_std_pairs_interleaved),
    ("rope_std", "bfloat16", rope_std_inv_freq_buffer_in_bf16),
    ("rope_std", "float32", rope_std_rotation_reversed),
    ("linear", "bfloat16", linear_bf16_accumulation),
    ("linear", "float32", linear_activations_in_q8_0_undeclared),
    ("linear", "bfloat16", linear_fp8_static_scale_saturating),
    ("gate_up", "float32", gate_up_gate_and_up_swapped),
    ("silu_mul", "float32", silu_mul_gate_and_up_swapped),
    ("gelu_mul", "float32", gelu_mul_gate_and_up_swapped),
    ("gelu_mul", "float32", gelu_mul_erf_gelu),
    ("residual", "float32", residual_r_ignored),
    ("embed", "bfloat16", embed_multiplier_missing),
    ("embed", "float32", embed_multiplier_rounded_to_bf16),
    ("lm_head", "float32", lm_head_softcap_before_multiplier),
    ("lm_head", "bfloat16", lm_head_bf16_accumulation),
    ("softmax", "float32", softmax_max_not_subtracted),
    ("softmax", "bfloat16", softmax_bf16_sum),
    ("causal_gqa", "float32", causal_gqa_mask_edge_off_by_one),
    ("causal_gqa", "bfloat16", causal_gqa_heads_interleaved),
    ("causal_gqa", "bfloat16", causal_gqa_bf16_value_accumulation),
    ("causal_gqa", "float32", causal_gqa_fp8_cache_read_without_its_scale),
    ("sliding_gqa", "float32", sliding_gqa_window_edge_off_by_one),
    ("sliding_gqa", "float32", sliding_gqa_heads_interleaved),
    ("decode_gqa", "float32", decode_gqa_heads_interleaved),
    ("decode_gqa", "bfloat16", decode_gqa_newest_key_masked),
    *((op, dtype, _attention_mutant(op, name, body))
      for op in ("causal_gqa", "sliding_gqa", "decode_gqa")
      for name, body in (("returns_zeros", _zeros), ("ignores_qk", _uniform_weights),
                         ("last_head_zeroed", _last_head_zeroed))
      for dtype in ("bfloat16", "float16")),
    *((op, "float32", _attention_mutant(op, "running_max_from_zero", _running_max_from_zero))
      for op in ("causal_gqa", "sliding_gqa", "decode_gqa")),
    ("rmsnorm", "float16", rmsnorm_squares_in_float16),
    ("gelu_tanh", "bfloat16", gelu_tanh_tanh_rounded_to_dtype),
    ("sigmoid_gate", "float32", sigmoid_gate_operands_swapped),
    ("sigmoid_gate", "bfloat16", sigmoid_gate_silu_instead_of_sigmoid),
]

# Each mutant as a backend the suite can load: --backend=tests.mutants:ADAPTERS.<mutant name>
# The mutants of engines that declare their formats run on such an engine (its ``formats``).
DECLARING = {causal_gqa_fp8_cache_read_without_its_scale: KV_DECLARED}
ADAPTERS = SimpleNamespace(**{mutant.__name__: MutantAdapter(op, mutant, DECLARING.get(mutant, reference))
                              for op, _, mutant in MUTANTS})
