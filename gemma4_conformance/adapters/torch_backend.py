"""PyTorch (CPU) adapter, computing each op the way Hugging Face transformers' Gemma code does.

* Elementwise ops, activations, softcaps, residuals, the embedding scale, attention logits, softmax
  and the weighted sum of values run in the dtype under test (torch's CPU kernels evaluate bf16/fp16
  arithmetic in float32 internally and round each op's result to the dtype).
* Matmuls (linear, gate_up, lm_head, attention) run in the dtype; torch's CPU matmul accumulates
  bf16/fp16 products in float32.
* Norms upcast to float32 (float64 stays float64), apply the weight there and cast back once.
* RoPE builds inverse frequencies and angles in float32 (float64 for float64), takes cos/sin there,
  casts them to the dtype and rotates in the dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

name = "torch"
dtypes = ("float64", "float32", "bfloat16", "float16")

_TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _t(a: np.ndarray) -> torch.Tensor:
    """A numpy array as a torch tensor of the same dtype and bits (bf16 goes through an int16 view)."""
    a = np.array(a)  # a contiguous, writable copy that torch may share
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _np(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as a numpy array of the same dtype and bits."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms and RoPE angles are computed in: float32, or float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Basic


def sigmoid(x):
    return _np(torch.sigmoid(_t(x)))


def silu(x):
    return _np(F.silu(_t(x)))


def gelu_tanh(x):
    return _np(F.gelu(_t(x), approximate="tanh"))


def _softcap(c, x: torch.Tensor) -> torch.Tensor:
    return c * torch.tanh(x / c)


def softcap(c, x):
    return _np(_softcap(c, _t(x)))


# Norm


def _rms_inverse(eps, x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms(eps, x):
    x = _t(x)
    wide = x.to(_wide(x.dtype))
    return _np(torch.sqrt(wide.pow(2).mean(-1) + eps).to(x.dtype))


def rmsnorm(eps, x, w):
    x, w = _t(x), _t(w)
    wide = x.to(_wide(x.dtype))
    return _np((wide * _rms_inverse(eps, wide) * w.to(wide.dtype)).to(x.dtype))


def rmsnorm_offset(eps, x, w):
    x, w = _t(x), _t(w)
    wide = x.to(_wide(x.dtype))
    return _np((wide * _rms_inverse(eps, wide) * (1.0 + w.to(wide.dtype))).to(x.dtype))


def rmsnorm_unit(eps, x):
    x = _t(x)
    wide = x.to(_wide(x.dtype))
    return _np((wide * _rms_inverse(eps, wide)).to(x.dtype))


def rmsnorm_gated(eps, x, z, w):
    x, z, w = _t(x), _t(z), _t(w)
    wide = x.to(_wide(x.dtype))
    gate = F.silu(z.to(wide.dtype))
    return _np((w.to(wide.dtype) * (wide * _rms_inverse(eps, wide)) * gate).to(x.dtype))


def l2norm(eps, x):
    x = _t(x)
    wide = x.to(_wide(x.dtype))
    return _np((wide * torch.rsqrt(wide.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype))


# Rope


def _inv_freq(theta, denom, active, i: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    freq = 1.0 / theta ** ((2 * i).to(wide) / denom)
    return torch.where(i < active, freq, torch.zeros((), dtype=wide))


def inv_freq(theta, denom, active, i, dtype):
    dtype = _TORCH_DTYPES[dtype]
    i = torch.from_numpy(np.array(i, dtype=np.int64))
    return _np(_inv_freq(theta, denom, active, i, _wide(dtype)).to(dtype))


def rope(theta, rot, denom, active, pos, x):
    x = _t(x)
    half = rot // 2
    if 2 * half > x.shape[-1]:
        raise ValueError(f"rope: rot={rot} rotates more than the {x.shape[-1]} coordinates of a head")
    wide = _wide(x.dtype)
    pos = torch.from_numpy(np.array(pos, dtype=np.int64))
    angle = pos.to(wide)[..., None] * _inv_freq(theta, denom, active, torch.arange(half), wide)
    angle = torch.cat((angle, angle), dim=-1)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x_rot, x_pass = x[..., : 2 * half], x[..., 2 * half :]
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return _np(torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1))


def rope_std(theta, rot, pos, x):
    return rope(theta, rot, rot, rot // 2, pos, x)


# Linear


def linear(W, x):
    return _np(_t(x) @ _t(W).T)


def gate_up(Wg, Wu, x):
    x = _t(x)
    return _np(torch.cat((x @ _t(Wg).T, x @ _t(Wu).T), dim=-1))


def silu_mul(gu):
    gate, up = _t(gu).chunk(2, dim=-1)
    return _np(F.silu(gate) * up)


def gelu_mul(gu):
    gate, up = _t(gu).chunk(2, dim=-1)
    return _np(F.gelu(gate, approximate="tanh") * up)


def residual(r, x, h):
    return _np(_t(x) + r * _t(h))


def embed(c, E, tokens):
    E = _t(E)
    # Gemma's scaled embedding casts its multiplier to the weight dtype first (sqrt(3840) -> 62.0 in bf16).
    scale = torch.tensor(c, dtype=E.dtype)
    return _np(E[torch.from_numpy(np.array(tokens, dtype=np.int64))] * scale)


def lm_head(mul, cap, W, x):
    logits = mul * (_t(x) @ _t(W).T)
    return _np(logits if cap is None else _softcap(cap, logits))


# Attention


def _masked_softmax(s: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    # A row with nothing visible softmaxes to NaN; zeroing every masked entry turns it into zeros.
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return p.masked_fill(~visible, 0.0)


def softmax(s, visible):
    return _np(_masked_softmax(_t(s), torch.from_numpy(np.array(visible, dtype=bool))))


def _gqa(scale, visible: torch.Tensor, q, k, v):
    """Attention of q [S, Hkv, G, D] over k, v [L, Hkv, D] with visible [S, L]."""
    q, k, v = _t(q), _t(k), _t(v)
    S, Hkv, G, D = q.shape
    q = q.reshape(S, Hkv * G, D).transpose(0, 1)  # query head c*G + g ...
    k = k.repeat_interleave(G, dim=1).transpose(0, 1)  # ... reads KV head c
    v = v.repeat_interleave(G, dim=1).transpose(0, 1)
    p = _masked_softmax((q @ k.transpose(1, 2)) * scale, visible)
    return _np((p @ v).transpose(0, 1).reshape(S, Hkv, G, D))


def _positions(pos, L):
    """Query positions as [S, 1] and key positions as [1, L], for building masks."""
    return torch.from_numpy(np.array(pos, dtype=np.int64))[:, None], torch.arange(L)[None, :]


def causal_gqa(scale, pos, q, k, v):
    p, l = _positions(pos, k.shape[0])
    return _gqa(scale, l <= p, q, k, v)


def sliding_gqa(scale, window, pos, q, k, v):
    p, l = _positions(pos, k.shape[0])
    return _gqa(scale, (l <= p) & (p < l + window), q, k, v)


def decode_gqa(scale, q, k, v):
    return causal_gqa(scale, [k.shape[0] - 1], q[None], k, v)[0]


def sigmoid_gate(o, gate):
    return _np(_t(o) * torch.sigmoid(_t(gate)))
