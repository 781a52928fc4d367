"""The fused kernels engines call from torch: attention through ``F.scaled_dot_product_attention`` (SDPA),
norms through ``F.rms_norm``; every other op as the eager torch backend computes it.

* ``causal_gqa``, ``sliding_gqa``, ``decode_gqa``: SDPA on q ``[1, Hkv*G, S, D]`` (query head c*G + g)
  and k, v ``[1, Hkv, L, D]`` with ``enable_gqa=True``, under which query head h reads KV head h // G,
  the contract's mapping; with ``gqa=repeat`` the KV heads are repeated G times first instead, as
  transformers' ``repeat_kv`` does for kernels without GQA.  The mask is the [S, L] visibility as a
  boolean (``mask=bool``) or as an additive 0 / -inf mask in the dtype (``mask=additive``); decode
  sees every key and passes none.  The op's ``scale`` is passed through (SDPA's default would be
  1/sqrt(D), which Gemma 4 does not use).  ``kernel=flash|efficient|cudnn|math`` forces one kernel
  through ``torch.nn.attention.sdpa_kernel``; by default torch chooses, and the kernel it chose for
  each dtype is recorded (``torch._fused_sdp_choice``) and reported.  On CUDA a forced flash or cuDNN
  kernel declares bf16 and fp16 only, the memory-efficient one float32 too; flash takes no mask
  there, so under it only ``decode_gqa`` runs (the others raise torch's "No available kernel").
* A query row with nothing visible is zeroed after the kernel (``torch.where`` on the row's
  any-visible), as the spec defines it: SDPA's softmax over no keys is 0/0, which torch's CPU kernels
  (2.5 and later) already return as 0 but fused kernels and older versions return as NaN; engines
  zero such rows or never form them (padding).  Nothing else is touched.
* ``rmsnorm``, ``rmsnorm_unit``: ``F.rms_norm`` in the dtype with the weight, or none;
  ``rmsnorm_offset``: the same with the weight 1 + w formed in the dtype (as an engine folds Gemma's
  offset into the weight: one rounding); ``rmsnorm_gated``: ``F.rms_norm(x, w)`` times ``silu(z)`` in
  the dtype.  ``rms`` and ``l2norm`` do not map onto it and stay eager.

``backend(device, tf32, reduced, kernel, mask, gqa)`` is the factory ``--backend=torch-sdpa[...]`` calls;
``device``, ``tf32`` and ``reduced`` as for ``torch`` (``torch_backend.py``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import DeviceError
from .torch_backend import Eager, TorchAdapter

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "memory-efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "math": SDPBackend.MATH}
NATIVE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch 2.5 and later
# The dtypes a forced CUDA kernel takes (torch's sdp_utils); on the CPU its flash and math kernels take all four.
CUDA_DTYPES = {"flash": ("bfloat16", "float16"), "cudnn": ("bfloat16", "float16"),
               "efficient": ("float32", "bfloat16", "float16"), "memory-efficient": ("float32", "bfloat16", "float16")}


class SDPA(Eager):
    """Eager torch with SDPA attention and ``F.rms_norm`` norms."""

    def __init__(self, kernel: str = "", mask: str = "bool", gqa: str = ""):
        if kernel and kernel not in KERNELS:
            raise ValueError(f"kernel is one of {', '.join(KERNELS)} (or not given: torch chooses), not {kernel!r}")
        if mask not in ("bool", "additive"):
            raise ValueError(f"mask is bool or additive, not {mask!r}")
        gqa = gqa or ("native" if NATIVE_GQA else "repeat")
        if gqa not in ("native", "repeat"):
            raise ValueError(f"gqa is native (enable_gqa=True) or repeat, not {gqa!r}")
        if gqa == "native" and not NATIVE_GQA:
            raise ValueError(f"gqa=native needs SDPA's enable_gqa (torch 2.5), which torch {torch.__version__} lacks")
        self.kernel, self.mask, self.gqa = KERNELS.get(kernel), mask, gqa
        self.chosen: dict[str, set[str]] = {}  # dtype -> the SDPA kernels that ran

    # Norm

    def rmsnorm(self, eps, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def rmsnorm_unit(self, eps, x):
        return F.rms_norm(x, (x.shape[-1],), None, eps)

    def rmsnorm_offset(self, eps, x, w):
        return F.rms_norm(x, (x.shape[-1],), 1 + w, eps)

    def rmsnorm_gated(self, eps, x, z, w):
        return F.rms_norm(x, (x.shape[-1],), w, eps) * F.silu(z)

    # Attention

    def _attend(self, scale, visible, q, k, v):
        """q [S, Hkv, G, D] over k, v [L, Hkv, D]; visible [S, L] or None (every key)."""
        S, Hkv, G, D = q.shape
        heads = q.reshape(S, Hkv * G, D).transpose(0, 1)[None]
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if self.gqa == "repeat":
            keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
        mask = visible
        if visible is not None and self.mask == "additive":
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
        options = {"attn_mask": mask, "scale": float(scale)}
        if self.gqa == "native":
            options["enable_gqa"] = True
        with sdpa_kernel([self.kernel]) if self.kernel is not None else nullcontext():
            self._note(heads, keys, values, options)
            out = F.scaled_dot_product_attention(heads, keys, values, **options)
        out = out[0].transpose(0, 1).reshape(S, Hkv, G, D)
        if visible is None:
            return out
        return torch.where(visible.any(-1)[:, None, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))

    def _note(self, q, k, v, options):
        """Record which kernel SDPA runs for these inputs (under the kernel selection in force)."""
        try:
            chosen = SDPBackend(torch._fused_sdp_choice(q, k, v, **options)).name.lower()
        except Exception as e:  # noqa: BLE001 - a private API: when it changes, say so rather than guess
            chosen = f"unknown ({type(e).__name__})"
        self.chosen.setdefault(str(q.dtype).removeprefix("torch."), set()).add(chosen)

    def _gqa(self, scale, visible, q, k, v):  # Eager's causal_gqa and sliding_gqa build the masks
        return self._attend(scale, visible, q, k, v)

    def decode_gqa(self, scale, q, k, v):
        return self._attend(scale, None, q[None], k, v)[0]

    def environment(self) -> dict:
        kernel = next((name for name, b in KERNELS.items() if b == self.kernel), None)
        return {"sdpa_kernel": f"{kernel} (forced)" if kernel else "torch's choice",
                "sdpa_kernels_run": {dtype: sorted(names) for dtype, names in sorted(self.chosen.items())},
                "sdpa_mask": self.mask, "sdpa_gqa": "enable_gqa=True" if self.gqa == "native" else "KV heads repeated",
                "norms": "F.rms_norm"}


def backend(device: str = "cpu", tf32: str = "", reduced: str = "", kernel: str = "", mask: str = "",
            gqa: str = "") -> TorchAdapter:
    """The fused torch backend (``--backend=torch-sdpa[kernel=math]``, ...); see the module docstring."""
    name = "torch-sdpa" + "".join(f"-{option}-{value}" for option, value in
                                  (("kernel", kernel), ("mask", mask), ("gqa", gqa)) if value)
    adapter = TorchAdapter(SDPA(kernel, mask or "bool", gqa), name, device, tf32, reduced)
    if adapter.torch_device.type != "cuda" and kernel in ("efficient", "memory-efficient", "cudnn"):
        raise DeviceError(f"torch's {kernel} SDPA kernel runs on CUDA only, not on {adapter.device}")
    if adapter.torch_device.type == "cuda" and kernel in CUDA_DTYPES:
        adapter.dtypes = CUDA_DTYPES[kernel]
    return adapter
