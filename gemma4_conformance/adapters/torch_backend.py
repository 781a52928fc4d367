"""PyTorch adapter, computing each op the way Hugging Face transformers' Gemma code does, on any device.

* Elementwise ops, activations, softcaps, residuals, the embedding scale, attention logits, softmax
  and the weighted sum of values run in the dtype under test (torch's CPU kernels evaluate bf16/fp16
  arithmetic in float32 internally and round each op's result to the dtype).
* Matmuls (linear, gate_up, lm_head, attention) run in the dtype; torch's CPU matmul accumulates
  bf16/fp16 products in float32 (cuBLAS does too, unless reduced-precision reductions or TF32 are on:
  see ``math_modes``).
* Norms upcast to float32 (float64 stays float64), apply the weight there and cast back once.
* RoPE builds inverse frequencies and angles in float32 (float64 for float64), takes cos/sin there,
  casts them to the dtype and rotates in the dtype.

The ops are written once, on tensors (``Eager``); ``TorchAdapter`` puts the contract's numpy arrays on
the device, runs an op there under the adapter's math modes and brings the result back.  Another
torch backend (``torch_sdpa.py``) subclasses ``Eager`` for the ops it computes differently.

``backend(device="cpu", tf32="", reduced="")`` is the factory ``--backend=torch[...]`` calls: ``device``
is ``cpu``, ``cuda``, ``cuda:N`` (``gpu`` is read as ``cuda``) or ``mps``; ``tf32=on|off`` forces
TF32 for float32 matmuls and cuDNN convolutions during this backend's ops (default: the process's
setting, which torch starts with off for matmuls); ``reduced=on|off`` forces cuBLAS's
reduced-precision reductions for bf16 and fp16 matmuls (default: the process's, which torch starts
with on); ``fp8=e4m3`` (or ``e4m3-tensor``) runs linear, gate_up and lm_head through ``torch._scaled_mm``
on float8_e4m3fn operands with dynamic float32 scales per token and per output channel (or per tensor),
as vLLM's fp8 linear does, and declares those formats (``Fp8Eager``, docs/quantized.md).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

from gemma4_conformance.adapters import DTYPES, DeviceError
from gemma4_conformance.spec import CONTRACT, OP_NAMES

TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def from_numpy(a) -> torch.Tensor:
    """A float array as a CPU tensor of the same dtype and bits (bfloat16 through its int16 view)."""
    a = np.array(a)  # a contiguous, writable copy that torch may share
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == ml_dtypes.bfloat16 \
        else torch.from_numpy(a)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array of the same dtype and bits."""
    t = t.detach().contiguous()
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms and RoPE angles are computed in: float32, or float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Eager:
    """Every op of the contract on torch tensors (on any one device), as transformers computes it."""

    # Basic

    def sigmoid(self, x):
        return torch.sigmoid(x)

    def silu(self, x):
        return F.silu(x)

    def gelu_tanh(self, x):
        return F.gelu(x, approximate="tanh")

    def softcap(self, c, x):
        return c * torch.tanh(x / c)

    # Norm

    def _rms_inverse(self, eps, x):
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rms(self, eps, x):
        wide = x.to(_wide(x.dtype))
        return torch.sqrt(wide.pow(2).mean(-1) + eps).to(x.dtype)

    def rmsnorm(self, eps, x, w):
        wide = x.to(_wide(x.dtype))
        return (wide * self._rms_inverse(eps, wide) * w.to(wide.dtype)).to(x.dtype)

    def rmsnorm_offset(self, eps, x, w):
        wide = x.to(_wide(x.dtype))
        return (wide * self._rms_inverse(eps, wide) * (1.0 + w.to(wide.dtype))).to(x.dtype)

    def rmsnorm_unit(self, eps, x):
        wide = x.to(_wide(x.dtype))
        return (wide * self._rms_inverse(eps, wide)).to(x.dtype)

    def rmsnorm_gated(self, eps, x, z, w):
        wide = x.to(_wide(x.dtype))
        gate = F.silu(z.to(wide.dtype))
        return (w.to(wide.dtype) * (wide * self._rms_inverse(eps, wide)) * gate).to(x.dtype)

    def l2norm(self, eps, x):
        wide = x.to(_wide(x.dtype))
        return (wide * torch.rsqrt(wide.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)

    # Rope

    def _inv_freq(self, theta, denom, active, i, wide):
        freq = 1.0 / theta ** ((2 * i).to(wide) / denom)
        return torch.where(i < active, freq, torch.zeros((), dtype=wide, device=i.device))

    def inv_freq(self, theta, denom, active, i, dtype):
        dtype = TORCH_DTYPES[dtype]
        return self._inv_freq(theta, denom, active, i, _wide(dtype)).to(dtype)

    def rope(self, theta, rot, denom, active, pos, x):
        half = rot // 2
        if 2 * half > x.shape[-1]:
            raise ValueError(f"rope: rot={rot} rotates more than the {x.shape[-1]} coordinates of a head")
        wide = _wide(x.dtype)
        angle = pos.to(wide)[..., None] * self._inv_freq(theta, denom, active, torch.arange(half, device=x.device), wide)
        angle = torch.cat((angle, angle), dim=-1)
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        x_rot, x_pass = x[..., : 2 * half], x[..., 2 * half :]
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)

    def rope_std(self, theta, rot, pos, x):
        return self.rope(theta, rot, rot, rot // 2, pos, x)

    # Linear

    def linear(self, W, x):
        return x @ W.T

    def gate_up(self, Wg, Wu, x):
        return torch.cat((x @ Wg.T, x @ Wu.T), dim=-1)

    def silu_mul(self, gu):
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_mul(self, gu):
        gate, up = gu.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def residual(self, r, x, h):
        return x + r * h

    def embed(self, c, E, tokens):
        # Gemma's scaled embedding casts its multiplier to the weight dtype first (sqrt(3840) -> 62.0 in bf16).
        return E[tokens] * torch.tensor(c, dtype=E.dtype, device=E.device)

    def lm_head(self, mul, cap, W, x):
        logits = mul * (x @ W.T)
        return logits if cap is None else self.softcap(cap, logits)

    # Attention

    def _masked_softmax(self, s, visible):
        # A row with nothing visible softmaxes to NaN; zeroing every masked entry turns it into zeros.
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        return p.masked_fill(~visible, 0.0)

    def softmax(self, s, visible):
        return self._masked_softmax(s, visible)

    def _gqa(self, scale, visible, q, k, v):
        """Attention of q [S, Hkv, G, D] over k, v [L, Hkv, D] with visible [S, L]."""
        S, Hkv, G, D = q.shape
        q = q.reshape(S, Hkv * G, D).transpose(0, 1)  # query head c*G + g ...
        k = k.repeat_interleave(G, dim=1).transpose(0, 1)  # ... reads KV head c
        v = v.repeat_interleave(G, dim=1).transpose(0, 1)
        p = self._masked_softmax((q @ k.transpose(1, 2)) * scale, visible)
        return (p @ v).transpose(0, 1).reshape(S, Hkv, G, D)

    def _positions(self, pos, L):
        """Query positions as [S, 1] and key positions as [1, L], for building masks."""
        return pos[:, None], torch.arange(L, device=pos.device)[None, :]

    def causal_gqa(self, scale, pos, q, k, v):
        p, l = self._positions(pos, k.shape[0])
        return self._gqa(scale, l <= p, q, k, v)

    def sliding_gqa(self, scale, window, pos, q, k, v):
        p, l = self._positions(pos, k.shape[0])
        return self._gqa(scale, (l <= p) & (p < l + window), q, k, v)

    def decode_gqa(self, scale, q, k, v):
        last = torch.tensor([k.shape[0] - 1], device=k.device)
        return self.causal_gqa(scale, last, q[None], k, v)[0]

    def sigmoid_gate(self, o, gate):
        return o * torch.sigmoid(gate)


# ----------------------------------------------------------------------------------------- devices


def build() -> str:
    """This torch's version and what it was built for, e.g. "torch 2.13.0+cpu, built without CUDA"."""
    if torch.version.hip:
        runtime = f"ROCm {torch.version.hip}"
    elif torch.version.cuda:
        runtime = f"CUDA {torch.version.cuda}"
    else:
        runtime = "built without CUDA"
    return f"torch {torch.__version__}, {runtime}"


def resolve_device(device: str) -> torch.device:
    """``device`` as a torch device that is there (``cuda`` is ``cuda:0``); ``DeviceError`` naming it and
    what torch found otherwise."""
    kind, _, index = device.strip().lower().partition(":")
    kind = "cuda" if kind == "gpu" else kind
    if kind not in ("cpu", "cuda", "mps") or (index and not index.isdigit()):
        raise DeviceError(f"torch cannot use the device {device!r}: its devices are cpu, cuda, cuda:N and mps")
    n = int(index or 0)
    if kind == "cuda":
        count = torch.cuda.device_count()
        if n >= count:
            seen = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(count))
            raise DeviceError(f"{device} not found: torch sees {count} CUDA device{'s' if count != 1 else ''}"
                              f"{': ' + seen if seen else ''} ({build()})")
    elif kind == "mps" and not torch.backends.mps.is_available():
        why = "this machine has none" if torch.backends.mps.is_built() else "this torch was built without MPS"
        raise DeviceError(f"{device} not found: torch sees no MPS device ({why}; {build()})")
    elif n != 0:
        raise DeviceError(f"{device} not found: torch has one {kind} device, {kind}:0 ({build()})")
    return torch.device(f"{kind}:{n}" if kind == "cuda" else kind)


def _nvidia_driver() -> str:
    """The NVIDIA kernel driver's version, from /proc (Linux), or "unknown"."""
    try:
        line = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"
    version = [word for word in line.split() if word[:1].isdigit() and "." in word]
    return version[0] if version else line.strip()


def device_environment(device: torch.device) -> dict:
    """The device's name and the runtime versions that decide its kernels, for the report."""
    env = {"device": str(device), "library": build()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["runtime"] = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        env["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none"
        env["driver"] = _nvidia_driver() if not torch.version.hip else "see rocm-smi"
    elif device.type == "mps":
        import platform

        env["device_name"] = "Apple MPS"
        env["runtime"] = f"macOS {platform.mac_ver()[0]}"
    else:
        env["device_name"] = "cpu"
        env["runtime"] = f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
    return env


# ----------------------------------------------------------------------------------------- math modes


def _switch(option: str, value: str) -> bool | None:
    """An on/off option: None when not given (the process's setting stands)."""
    if value in ("", None):
        return None
    if value not in ("on", "off"):
        raise ValueError(f"{option} is on or off, not {value!r}")
    return value == "on"


def _read(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - torch refuses to read a mix of its old and new TF32 APIs
        if "mix of the legacy and new APIs" in str(e):
            return "not readable: set through the newer fp32_precision API, which torch does not mix with this one"
        return f"not readable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _tf32_matmul() -> bool:
    """Whether float32 matmuls may use TF32 now, by whichever API this torch has."""
    new = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if new in ("tf32", "ieee"):
        return new == "tf32"
    return _read(lambda: torch.backends.cuda.matmul.allow_tf32) is True


def _tf32_conv() -> bool:
    conv = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    if conv in ("tf32", "ieee"):
        return conv == "tf32"
    return _read(lambda: torch.backends.cudnn.allow_tf32) is True


def math_modes() -> dict:
    """The settings in force that decide how torch rounds: TF32 (by both its old and new APIs), the
    reduced-precision reductions of bf16/fp16 matmuls, the float32 matmul precision, and oneDNN's
    on the CPU."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    modes = {
        "tf32_matmul": "on" if _tf32_matmul() else "off",
        "tf32_cudnn_conv": "on" if _tf32_conv() else "off",
        "cuda.matmul.allow_tf32": _read(lambda: matmul.allow_tf32),
        "cudnn.allow_tf32": _read(lambda: cudnn.allow_tf32),
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        "cuda.matmul.allow_bf16_reduced_precision_reduction":
            _read(lambda: matmul.allow_bf16_reduced_precision_reduction),
        "cuda.matmul.allow_fp16_reduced_precision_reduction":
            _read(lambda: matmul.allow_fp16_reduced_precision_reduction),
    }
    if hasattr(matmul, "fp32_precision"):  # the newer API (torch 2.9)
        modes["cuda.matmul.fp32_precision"] = matmul.fp32_precision
        modes["cudnn.conv.fp32_precision"] = _read(lambda: cudnn.conv.fp32_precision)
        modes["mkldnn.matmul.fp32_precision"] = _read(lambda: torch.backends.mkldnn.matmul.fp32_precision)
    return modes


@contextmanager
def forced_modes(tf32: bool | None, reduced: bool | None):
    """TF32 and reduced-precision reductions forced on or off (None: left as they are) while inside,
    and restored after, by the API this torch has (mixing its old and new TF32 APIs is an error)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = []

    def force(owner, attribute, value):
        saved.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, value)

    try:
        if tf32 is not None:
            if hasattr(matmul, "fp32_precision"):
                force(matmul, "fp32_precision", "tf32" if tf32 else "ieee")
                force(cudnn.conv, "fp32_precision", "tf32" if tf32 else "ieee")
            else:
                force(matmul, "allow_tf32", tf32)
                force(cudnn, "allow_tf32", tf32)
        if reduced is not None:
            force(matmul, "allow_bf16_reduced_precision_reduction", reduced)
            force(matmul, "allow_fp16_reduced_precision_reduction", reduced)
        yield
    finally:
        for owner, attribute, value in reversed(saved):
            setattr(owner, attribute, value)


class Fp8Eager(Eager):
    """``Eager`` with its products through ``torch._scaled_mm``: x (each token, or the whole tensor) and W
    (each output channel, or the whole tensor) rounded to float8_e4m3fn by the dynamic scale max |.| / 448
    in float32, saturating (a value past 448 cannot arise: the scale maps the largest to 448), the fp8
    products accumulated in float32 and multiplied by both scales, the result in the dtype."""

    LARGEST = 448.0  # float8_e4m3fn's largest finite value: it has no inf

    def __init__(self, per_row: bool):
        self.per_row = per_row

    def _quantized(self, t):
        """(q, scale) of a matrix: scale [rows, 1] per row, or [] per tensor; a group of zeros scales by 1."""
        wide = t.to(torch.float32)
        a = wide.abs().amax(dim=-1, keepdim=True) if self.per_row else wide.abs().amax()
        scale = torch.where(a > 0, a / self.LARGEST, torch.ones_like(a))
        return (wide / scale).clamp(-self.LARGEST, self.LARGEST).to(torch.float8_e4m3fn), scale

    def _scaled(self, W, x):
        rows = x.reshape(-1, x.shape[-1])
        qx, sx = self._quantized(rows)
        qw, sw = self._quantized(W)
        out = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], W.shape[0])

    def linear(self, W, x):
        return self._scaled(W, x)

    def gate_up(self, Wg, Wu, x):
        return torch.cat((self._scaled(Wg, x), self._scaled(Wu, x)), dim=-1)

    def lm_head(self, mul, cap, W, x):
        logits = mul * self._scaled(W, x)
        return logits if cap is None else self.softcap(cap, logits)


# torch[fp8=...] -> (one scale per row, the formats it declares)
FP8 = {"e4m3": (True, {"activations": "fp8_e4m3_token", "weights": "fp8_e4m3_channel"}),
       "e4m3-tensor": (False, {"activations": "fp8_e4m3_tensor", "weights": "fp8_e4m3_tensor"})}
FP8_DTYPES = ("float32", "bfloat16", "float16")  # torch._scaled_mm's out_dtype takes no float64


# ----------------------------------------------------------------------------------------- the adapter


class TorchAdapter:
    """The contract's numpy boundary around ``kernels`` (an ``Eager``): arrays go to ``device``, each op
    runs there under the adapter's math modes, and its result comes back as numpy in the dtype."""

    dtypes = DTYPES

    def __init__(self, kernels: Eager, name: str, device: str = "cpu", tf32: str = "", reduced: str = ""):
        self.kernels = kernels
        self.torch_device = resolve_device(device)
        self.device = str(self.torch_device)
        self.tf32, self.reduced = _switch("tf32", tf32), _switch("reduced", reduced)
        self.forced = [f"{option}={value}" for option, value in (("tf32", tf32), ("reduced", reduced)) if value]
        self.name = name + "".join("-" + option.replace("=", "-") for option in self.forced)
        self.transfer_seconds = 0.0
        # Run-to-run invariance measured to hold on the CPU in float32 and bfloat16 (docs/invariance.md); on a
        # GPU, where kernels may add with atomics, it was not measured, so nothing is claimed there.
        self.invariance = frozenset({"run"}) if self.torch_device.type == "cpu" else frozenset()

    def _modes(self):
        # nothing forced: no context to enter, which costs as much as a small op's kernel
        return forced_modes(self.tf32, self.reduced) if self.forced else nullcontext()

    def _tensor(self, a, kind: str):
        """A contract argument as the op takes it: arrays as tensors on the device, bits unchanged."""
        if kind == "float":
            t = from_numpy(a)
        elif kind == "index":
            t = torch.from_numpy(np.array(a, dtype=np.int64))
        elif kind == "mask":
            t = torch.from_numpy(np.array(a, dtype=bool))
        else:
            return a
        if self.torch_device.type == "cpu":
            return t
        start = time.perf_counter()
        t = t.to(self.torch_device)
        self.transfer_seconds += time.perf_counter() - start
        return t

    def _array(self, t: torch.Tensor) -> np.ndarray:
        """A result tensor as a numpy array of the same dtype and bits."""
        if self.torch_device.type != "cpu":
            torch.cuda.synchronize(self.torch_device) if self.torch_device.type == "cuda" else torch.mps.synchronize()
            start = time.perf_counter()
            t = t.cpu()
            self.transfer_seconds += time.perf_counter() - start
        return to_numpy(t)

    def environment(self) -> dict:
        """The device, its runtime and the math modes this backend's ops run under, for the report."""
        with self._modes():
            modes = math_modes()
        env = device_environment(self.torch_device)
        env["math_modes"] = modes
        env["math_modes_source"] = (f"forced by the backend's options ({', '.join(self.forced)})" if self.forced
                                    else "the process's settings, as the run found them")
        env["math_summary"] = _summary(modes, self.torch_device)
        if hasattr(self.kernels, "environment"):
            env.update(self.kernels.environment())
        return env


def _summary(modes: dict, device: torch.device) -> str:
    """The modes that change a verdict, in a few words (the report puts them beside a failure)."""
    if device.type == "cuda":
        reduced = [dt for dt in ("bf16", "fp16") if modes[f"cuda.matmul.allow_{dt}_reduced_precision_reduction"] is True]
        return (f"TF32 for float32 matmuls {modes['tf32_matmul']}, for cuDNN convolutions {modes['tf32_cudnn_conv']}; "
                f"reduced-precision reductions in {' and '.join(reduced) or 'no'} matmuls")
    onednn = modes.get("mkldnn.matmul.fp32_precision", "none")
    cpu = "IEEE float32" if onednn in ("none", "ieee") else f"{onednn} (oneDNN fp32_precision)"
    return f"float32 matmuls in {cpu}; TF32 and cuBLAS's reductions apply on CUDA only" if device.type == "cpu" \
        else "MPS kernels; TF32 and cuBLAS's reductions apply on CUDA only"


def _contract_method(op: str):
    kinds = tuple(arg.kind for arg in CONTRACT[op].args)

    def method(self, *args, **kwargs):
        tensors = [self._tensor(a, kind) for a, kind in zip(args, kinds)]
        with torch.no_grad(), self._modes():
            out = getattr(self.kernels, op)(*tensors, **kwargs)
        return self._array(out)

    method.__name__ = method.__qualname__ = op
    method.__doc__ = f"``{op}`` of the contract, computed on the adapter's device."
    return method


for _op in OP_NAMES:
    setattr(TorchAdapter, _op, _contract_method(_op))


def backend(device: str = "cpu", tf32: str = "", reduced: str = "", fp8: str = "") -> TorchAdapter:
    """The eager torch backend (``--backend=torch[tf32=on]``, ...); see the module docstring."""
    if not fp8:
        return TorchAdapter(Eager(), "torch", device, tf32, reduced)
    if fp8 not in FP8:
        raise ValueError(f"fp8 is one of {', '.join(FP8)}, not {fp8!r}")
    per_row, formats = FP8[fp8]
    adapter = TorchAdapter(Fp8Eager(per_row), f"torch-fp8-{fp8}", device, tf32, reduced)
    adapter.formats, adapter.dtypes = formats, FP8_DTYPES
    return adapter
