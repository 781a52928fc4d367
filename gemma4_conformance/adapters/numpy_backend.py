"""The reference backend: every op in plain numpy, as a float32 (or float64) engine would compute it.

float64 inputs are computed in float64.  float32, float16 and bfloat16 inputs are widened exactly to
float32, computed there, and the result is rounded once to the input dtype at the end of the op.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys

import numpy as np

from gemma4_conformance.adapters import kv_cache_format
from gemma4_conformance.checkpoints.quantized import (FP8_ACTIVATIONS, FP8_WEIGHTS, QuantizedWeight, read_from_fp8, rounded_activations,
                                                     rounded_to_fp8, stored_in_fp8)
from gemma4_conformance.spec import CONTRACT, format_of
from gemma4_conformance.spec.exact import one_blas_thread

name = "numpy"
dtypes = ("float64", "float32", "bfloat16", "float16")
device = "cpu"  # always, whatever --device says
# Measured (docs/invariance.md): a schedule played again gives bitwise the same logits; the batch and the
# chunking do not (BLAS picks its kernel by the number of rows, numpy's sums split by their length).
invariance = frozenset({"run"})

# The ops whose products may go to BLAS run it on one thread: the same sums whatever the machine's cores
# and pytest-xdist's workers, and no BLAS threads spinning against other processes on small products
# (docs/performance.md).
_ONE_BLAS_THREAD = frozenset({"linear", "gate_up", "lm_head", "causal_gqa", "sliding_gqa", "decode_gqa"})


def _compute_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _widen(value, kind: str, ct: np.dtype):
    if kind == "float":
        return np.asarray(value).astype(ct)
    if kind == "real" or (kind == "cap" and value is not None):
        return ct.type(value)
    if kind == "mask":
        return np.asarray(value, dtype=bool)
    if kind == "index":
        return np.asarray(value)
    return value


def _op(fn):
    """Make ``fn`` an op of the contract: floating arrays and real scalars widened to the compute
    dtype, the result rounded once to the dtype under test.  ``op.wide`` is ``fn`` itself, for ops
    built from other ops without rounding in between.
    """
    kinds = [arg.kind for arg in CONTRACT[fn.__name__].args]

    threads = one_blas_thread if fn.__name__ in _ONE_BLAS_THREAD else contextlib.nullcontext

    @functools.wraps(fn)
    def op(*args):
        dtype = next(np.asarray(a).dtype for a, kind in zip(args, kinds) if kind == "float")
        ct = _compute_dtype(dtype)
        with threads():
            wide = np.asarray(fn(*(_widen(a, kind, ct) for a, kind in zip(args, kinds))))
        with np.errstate(over="ignore"):  # beyond the dtype's range the rounding is inf, as the spec's is
            return wide.astype(dtype)

    op.wide = fn
    return op


# Basic


@_op
def sigmoid(x):
    e = np.exp(-np.abs(x))  # never overflows; 1/(1+e) for x >= 0, e/(1+e) for x < 0
    return np.where(x >= 0, 1, e) / (1 + e)


@_op
def silu(x):
    return x * sigmoid.wide(x)


@_op
def gelu_tanh(x):
    k = x.dtype.type(math.sqrt(2 / math.pi))
    a = x.dtype.type(0.044715)
    with np.errstate(over="ignore"):  # x**3 overflows only where tanh has long saturated to +-1
        return x / 2 * (1 + np.tanh(k * (x + a * x**3)))


@_op
def softcap(c, x):
    return c * np.tanh(x / c)


# Norm (over the last axis)


@_op
def rms(eps, x):
    return np.sqrt(np.mean(x * x, axis=-1) + eps)


@_op
def rmsnorm(eps, x, w):
    return x / rms.wide(eps, x)[..., None] * w


@_op
def rmsnorm_offset(eps, x, w):
    return x / rms.wide(eps, x)[..., None] * (1 + w)


@_op
def rmsnorm_unit(eps, x):
    return x / rms.wide(eps, x)[..., None]


@_op
def rmsnorm_gated(eps, x, z, w):
    return w * (x / rms.wide(eps, x)[..., None]) * silu.wide(z)


@_op
def l2norm(eps, x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


# Rope


def _inv_freq(theta, denom, active, i):
    """theta^(-2i/denom) for i < active, else 0, in the dtype of the scalar ``theta``."""
    ct = theta.dtype
    exponent = (-2 * i).astype(ct) / ct.type(denom)
    return np.where(i < active, theta**exponent, 0).astype(ct)


def inv_freq(theta, denom, active, i, dtype):
    dtype = format_of(dtype).dtype
    return _inv_freq(_compute_dtype(dtype).type(theta), denom, active, np.asarray(i)).astype(dtype)


@_op
def rope(theta, rot, denom, active, pos, x):
    half = rot // 2
    D = x.shape[-1]
    # Zero-pad when rot > D: Lean reads a rotation partner past the last coordinate as 0.
    x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, max(0, 2 * half - D))])
    angle = pos[..., None].astype(x.dtype) * _inv_freq(theta, denom, active, np.arange(half))
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = x.copy()  # coordinates from 2*half on pass through
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x2 * cos + x1 * sin
    return out[..., :D]


@_op
def rope_std(theta, rot, pos, x):
    return rope.wide(theta, rot, rot, rot // 2, pos, x)


# Linear


@_op
def linear(W, x):
    return x @ W.T


@_op
def gate_up(Wg, Wu, x):
    return np.concatenate([linear.wide(Wg, x), linear.wide(Wu, x)], axis=-1)


@_op
def silu_mul(gu):
    gate, up = np.split(gu, 2, axis=-1)
    return silu.wide(gate) * up


@_op
def gelu_mul(gu):
    gate, up = np.split(gu, 2, axis=-1)
    return gelu_tanh.wide(gate) * up


@_op
def residual(r, x, h):
    return x + r * h


@_op
def embed(c, E, tokens):
    return c * E[tokens]


@_op
def lm_head(mul, cap, W, x):
    logits = mul * linear.wide(W, x)
    return logits if cap is None else softcap.wide(cap, logits)


# Attention


@_op
def softmax(s, visible):
    m = np.max(s, axis=-1, keepdims=True, where=visible, initial=-np.inf)
    # Masked entries may overflow exp(s - m), and a row with nothing visible has m = -inf;
    # both are discarded by the where.
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.where(visible, np.exp(s - m), 0)
    total = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1)


def _gqa(scale, visible, q, k, v):
    """``q [S, Hkv, G, D]``, ``k, v [L, Hkv, D]``, ``visible [S, L]``.

    Query head c*G + g is q[:, c, g] and reads KV head c: the einsums share the index c between q and k, v.
    In float64 (the reference, which the oracle certifies) the products go through BLAS, 22 x faster
    at 1036 keys of head dim 256; in float32 they keep einsum's plain sequential sums, the baseline
    against which the forward and serving verdicts were measured.
    """
    blas = q.dtype == np.float64
    logits = scale * np.einsum("scgd,lcd->scgl", q, k, optimize=blas)
    p = softmax.wide(logits, visible[:, None, None, :])
    return np.einsum("scgl,lcd->scgd", p, v, optimize=blas)


@_op
def causal_gqa(scale, pos, q, k, v):
    l = np.arange(k.shape[0])
    return _gqa(scale, l <= pos[:, None], q, k, v)


@_op
def sliding_gqa(scale, window, pos, q, k, v):
    l = np.arange(k.shape[0])
    p = pos[:, None]
    return _gqa(scale, (l <= p) & (p < l + window), q, k, v)


@_op
def decode_gqa(scale, q, k, v):
    L = k.shape[0]
    return causal_gqa.wide(scale, np.array([L - 1]), q[None], k, v)[0]


@_op
def sigmoid_gate(o, gate):
    return o * sigmoid.wide(gate)


class RoundsAsDeclared:
    """These ops rounding where ``formats`` (an adapter's declared formats) say an engine rounds beyond the
    dtype: the products (``linear``, ``gate_up``, ``lm_head``) on x rounded to the ``activations`` format
    first (``checkpoints.quantized.rounded_activations``: llama.cpp's CPU path, or an fp8 GEMM's dynamic
    scaling) and on W rounded to an fp8 ``weights`` format (``rounded_to_fp8``; a block format is the
    checkpoint's own and is not rounded again; the op tests hand it as a ``QuantizedWeight``, read here as
    its exact values), and attention on k and v stored in the ``kv_cache`` format and read back
    (``stored_in_fp8``, ``read_from_fp8``: vLLM's fp8 KV cache).  The plain baseline of a forward whose
    engine declares ``formats`` (properties/forward.py), and an engine that rounds so
    (tests/quantized_engines.py), declaring it where ``declare``."""

    dtypes = dtypes
    PRODUCTS = ("linear", "gate_up", "lm_head")
    ATTENTION = ("causal_gqa", "sliding_gqa", "decode_gqa")

    def __init__(self, formats: dict[str, str], name: str | None = None, declare: bool = False):
        self.rounds = {key: value for key, value in formats.items() if key in ("activations", "kv_cache")
                       or (key == "weights" and value in FP8_WEIGHTS)}
        self.name = name or "numpy rounding as declared: " + ", ".join(f"{k} {v}" for k, v in self.rounds.items())
        if declare:
            self.formats = dict(formats)
        if "kv_cache" in self.rounds:
            self.kv = kv_cache_format(self.rounds["kv_cache"])

    def read_cache(self, stored: np.ndarray, scale: float, dtype) -> np.ndarray:
        return read_from_fp8(stored, scale, dtype)

    def _cached(self, x, scale):
        return self.read_cache(stored_in_fp8(x, self.kv[0], scale), scale, x.dtype)

    def round_x(self, x: np.ndarray) -> np.ndarray:
        """x as the products take it: rounded to the declared activation format, where there is one."""
        activations = self.rounds.get("activations")
        return rounded_activations(x, activations) if activations else x

    def dequantize(self, weight: QuantizedWeight) -> np.ndarray:
        """A weight held in a block format, as its exact values (a mutant reads its blocks wrongly here)."""
        return weight.values()

    def _product(self, op):
        weights = self.rounds.get("weights")
        # an fp8 GEMM's products are exact and accumulate in float32, as are a block format's integer dot
        # products: computed in float64 here, rounded once
        fp8 = weights is not None or self.rounds.get("activations") in FP8_ACTIVATIONS

        def run(*args):
            *head, x = args
            held = any(isinstance(a, QuantizedWeight) for a in head)
            if held:
                head = [self.dequantize(a) if isinstance(a, QuantizedWeight) else a for a in head]
            if not (fp8 or held):
                return op(*head, self.round_x(x))  # in the weights' dtype, the run's
            head = [rounded_to_fp8(a, *FP8_WEIGHTS[weights]) if weights and isinstance(a, np.ndarray) and a.ndim == 2
                    else a for a in head]
            with np.errstate(over="ignore"):
                return np.asarray(op(*head, np.asarray(self.round_x(x), np.float64)), np.float64).astype(x.dtype)

        return run

    def _wrapped(self, name, op):
        if name in self.PRODUCTS:
            run = self._product(op)
        elif name in self.ATTENTION and "kv_cache" in self.rounds:
            def run(*args):
                *head, k, v = args
                return op(*head, self._cached(k, self.kv[1]), self._cached(v, self.kv[2]))
        else:
            return op
        return functools.wraps(op)(run)

    def __getattr__(self, attribute):  # the rest is this module's: its ops, device and invariance
        return self._wrapped(attribute, getattr(sys.modules[__name__], attribute))
