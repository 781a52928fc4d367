"""The fused attention engines call from JAX: ``jax.nn.dot_product_attention``; every other op as the jax
backend computes it.

* ``causal_gqa``, ``sliding_gqa``, ``decode_gqa``: ``jax.nn.dot_product_attention`` on query
  ``[1, S, Hkv*G, D]`` (query head c*G + g) and key, value ``[1, L, Hkv, D]``; it groups query heads
  as query head h reads KV head h // G, the contract's mapping.  The mask is the [S, L] visibility as
  a boolean; decode sees every key and passes none.  The op's ``scale`` is passed through (the
  default would be 1/sqrt(D)).  ``implementation=xla`` (default) or ``cudnn`` (NVIDIA GPUs, bf16 and
  fp16 only, so that backend declares only those dtypes; and head dimensions up to 256 that are
  multiples of 8 (``HEAD_DIMS``): it raises ``Unsupported`` beyond them, so Gemma 4's global layers,
  of head dimension 512, are reported as a configuration that cannot run them, not as a crash).
* It is called eagerly, not under ``jax.jit``.  It asks for the dot algorithms BF16_BF16_F32 and
  F16_F16_F32 and falls back to the default precision where the platform lacks them, but that
  fallback (a ``try`` around the einsum) only sees errors raised while the einsum compiles, which
  under jit happens later, outside it: jitted on the CPU (jax 0.10.2), every float16 call and a
  bf16 call whose dot is a scalar (one query, one key, head dimension 1) raise ``The precision
  'F16_F16_F32' is not supported by dot_general on CPU`` / ``Algorithm not supported by the
  ElementalIrEmitter: ALG_DOT_BF16_BF16_F32`` (tests/test_devices.py keeps that finding checked).  Eager or jitted, the ops and their dtypes are
  the same, so the numerics judged are those an engine's jitted call gets where it compiles.
* It computes the softmax in float32 whatever the input dtype (``_dot_product_attention_core`` casts
  the logits to float32: "Softmax ... is always carried out in fp32"), so it is not a float64
  kernel: float64 inputs get float32 probabilities, up to 1e7 times the float64 budgets on the
  suite's examples (tests/test_devices.py keeps that checked).  The backend declares float32,
  bfloat16 and float16, and its report entry says why not float64.
* A query row with nothing visible is zeroed after the call (``jnp.where`` on the row's any-visible),
  as the spec defines it: the XLA implementation fills masked logits with a large negative number
  rather than -inf, so a row without visible keys comes out as the plain mean of all values.

``backend(device, precision, implementation)`` is the factory ``--backend=jax-sdpa[...]`` calls;
``device`` and ``precision`` as for ``jax`` (``jax_backend.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import jax_backend
from .contract import Unsupported
from .jax_backend import PRECISION, JaxAdapter

IMPLEMENTATIONS = ("xla", "cudnn")
NOT_FLOAT64 = ("jax.nn.dot_product_attention computes the softmax in float32 whatever the input dtype, "
               "so float64 is not declared (measured: up to 1e7 times the float64 budgets)")


HEAD_DIMS = "cuDNN's fused attention takes head dimensions up to 256 that are multiples of 8"


def _attend(scale, visible, q, k, v, implementation):
    """q [S, Hkv, G, D] over k, v [L, Hkv, D]; visible [S, L] or None (every key)."""
    S, Hkv, G, D = q.shape
    if implementation == "cudnn" and (D > 256 or D % 8):  # stated here: jax raises NotImplementedError
        raise Unsupported(f"{HEAD_DIMS}, not {D}")
    out = jax.nn.dot_product_attention(q.reshape(1, S, Hkv * G, D), k[None], v[None],
                                       mask=None if visible is None else visible[None, None],
                                       scale=scale, implementation=implementation)
    out = out.reshape(S, Hkv, G, D)
    return out if visible is None else jnp.where(visible.any(-1)[:, None, None, None], out, 0)


def _visible(pos, L, window=None):
    p, l = pos[:, None], jnp.arange(L)[None, :]
    return (l <= p) if window is None else (l <= p) & (p < l + window)


class Kernels:
    """The jax backend's jitted ops with the attention ops through ``jax.nn.dot_product_attention``."""

    def __init__(self, implementation: str):
        self.implementation = implementation

    def __getattr__(self, op):  # every op not defined here is the jax backend's
        return getattr(jax_backend.OPS, op)

    def causal_gqa(self, scale, pos, q, k, v):
        return _attend(float(scale), _visible(pos, k.shape[0]), q, k, v, self.implementation)

    def sliding_gqa(self, scale, window, pos, q, k, v):
        return _attend(float(scale), _visible(pos, k.shape[0], window), q, k, v, self.implementation)

    def decode_gqa(self, scale, q, k, v):
        return _attend(float(scale), None, q[None], k, v, self.implementation)[0]

    def environment(self) -> dict:
        return {"attention": f"jax.nn.dot_product_attention(implementation={self.implementation!r}), called eagerly"
                             + (f"; {HEAD_DIMS}" if self.implementation == "cudnn" else ""),
                "dtypes_left_out": {"float64": NOT_FLOAT64} | ({"float32": "cuDNN's fused attention takes bf16 and "
                                                                           "fp16 only"}
                                                               if self.implementation == "cudnn" else {})}


def backend(device: str = "cpu", precision: str = PRECISION, implementation: str = "") -> JaxAdapter:
    """The fused jax backend (``--backend=jax-sdpa[implementation=cudnn]``, ...); see the module docstring."""
    if implementation and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation is xla or cudnn, not {implementation!r}")
    name = "jax-sdpa" + (f"-implementation-{implementation}" if implementation else "")
    adapter = JaxAdapter(Kernels(implementation or "xla"), name, device, precision)
    # cuDNN's fused attention takes bf16 and fp16 only; XLA's softmaxes in float32 (NOT_FLOAT64).
    adapter.dtypes = ("bfloat16", "float16") if implementation == "cudnn" else ("float32", "bfloat16", "float16")
    return adapter
