"""The JAX backend: each op computed the way a Flax/MaxText Gemma computes it, on any JAX device.

* Elementwise ops (activations, softcap, residual, embedding scale, gates) run in the dtype under
  test, with Python scalars weakly typed so they take that dtype; GELU is evaluated in float32 and
  rounded once (jax.nn.gelu in bf16 cancels its negative tail to 0; see ``_gelu``).
* Norms upcast to float32, normalise with ``rsqrt``, apply the weight in float32 and cast back.
* RoPE builds inverse frequencies and angles in float32, casts cos/sin to the dtype and rotates in it.
* Matmuls (linear, gate/up, LM head, both attention einsums) take dtype inputs and accumulate in
  float32 (``preferred_element_type``), then cast to the dtype; softmax runs in the dtype.  They run
  under ``jax.default_matmul_precision("highest")``: otherwise XLA may run float32 matmuls in
  reduced precision (TF32 or bf16 passes on GPUs and TPUs).

float64 replaces float32 in all of the above when it is the dtype under test.  Each op is one jitted
computation, compiled per shape, dtype and static argument; ``JaxAdapter`` puts the contract's numpy
arrays on the adapter's device, runs the op there under its matmul precision and brings the result
back as numpy.  A compilation takes 0.1 to 1.5 s and a run draws thousands of shapes, so, as a
JAX server pads its batches: independent rows (the leading axes), queries and keys are padded to the
next power of two on the way in (``_padded``), and compiled programs are kept between runs in JAX's
persistent compilation cache (``_compilation_cache``).  Each program in memory holds 3 to 20 memory
maps on the CPU, and Linux lets a process hold 65530 (vm.max_map_count): a thorough run compiled
over 7000 programs, and XLA crashed with a segmentation fault when mmap failed, so ``MapBudget``
drops the programs held in memory when the maps near half the limit (the disk cache reloads them).

``backend(device="cpu", precision="highest")`` is the factory ``--backend=jax[...]`` calls: ``device``
is ``cpu``, ``gpu``, ``gpu:N`` (``cuda`` is read as ``gpu``) or ``tpu``; ``precision`` is a value of
``jax_default_matmul_precision`` (``default``, ``high``, ``highest``, ``tensorfloat32``, ``float32``,
``bfloat16``, ...) or ``inherit`` for the process's own setting (``JAX_DEFAULT_MATMUL_PRECISION``).
"""

from __future__ import annotations

import functools
import os
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gemma4_conformance.adapters import DTYPES, DeviceError
from gemma4_conformance.spec import CONTRACT, OP_NAMES

# Without x64, JAX silently turns float64 inputs into float32 (and int64 positions into int32), so
# float64 could not be tested.  It also makes default dtypes 64-bit, hence explicit dtypes below.
jax.config.update("jax_enable_x64", True)

def _compilation_cache() -> None:
    """Keep every compiled program on disk: in $GEMMA4_CONFORMANCE_JAX_CACHE (default
    ~/.cache/gemma4-conformance/jax; empty turns it off), unless JAX_COMPILATION_CACHE_DIR names
    JAX's own.  Each is small and quick to compile, so the cache takes all of them."""
    if jax.config.jax_compilation_cache_dir is None:
        folder = os.environ.get("GEMMA4_CONFORMANCE_JAX_CACHE",
                                str(Path("~/.cache/gemma4-conformance/jax").expanduser()))
        if not folder:
            return
        jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


_compilation_cache()

# Seconds this process spent turning ops into programs (jax.monitoring's durations: tracing, lowering,
# and compiling or reading the persistent cache), and the programs the cache gave: in each backend's
# environment, as most of a jax run's time on a GPU is compiling (docs/gpu.md).
COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration"}
COMPILING = {"seconds": 0.0, "persistent_cache_hits": 0}


def _compile_duration(event: str, duration: float, **_) -> None:
    if event in COMPILE_EVENTS:
        COMPILING["seconds"] += duration


def _compile_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        COMPILING["persistent_cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_compile_duration)
jax.monitoring.register_event_listener(_compile_event)


class MapBudget:
    """Clears JAX's in-memory programs (``jax.clear_caches``) whenever the process's memory maps pass
    ``fraction`` of the kernel's limit; it counts them every ``every`` ops, as reading
    /proc/self/maps costs about 0.7 us a map (23 ms at half the limit).  Where there is no such
    limit (not Linux) it does nothing."""

    def __init__(self, fraction: float = 0.5, every: int = 64):
        try:
            self.limit = int(Path("/proc/sys/vm/max_map_count").read_text()) * fraction
        except (OSError, ValueError):
            self.limit = None
        self.every = every
        self.calls = 0
        self.clears = 0

    @staticmethod
    def maps() -> int:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")

    def tick(self) -> None:
        self.calls += 1
        if self.limit is not None and self.calls % self.every == 0 and self.maps() > self.limit:
            jax.clear_caches()
            self.clears += 1


MAP_BUDGET = MapBudget()

PRECISION = "highest"  # the matmul precision the backend's ops run under unless told otherwise


def _op(*static):
    """Jit an op, with ``static`` the arguments that fix shapes or control flow.

    Jitting the whole op compiles one program per new shape; eager dispatch compiles every primitive
    separately and was about 3.5x slower on the many small shapes the suite draws.  Python scalars
    are traced as weakly typed values, so they still take the dtype of the arrays they meet.
    """

    def wrap(fn):
        return functools.wraps(fn)(jax.jit(fn, static_argnames=static))

    return wrap


def _bucket(n: int) -> int:
    """The next power of two at or above ``n``: the only sizes a padded axis is compiled for."""
    return 1 << max(n - 1, 0).bit_length()


def _pad(a, n: int):
    """``a`` padded with zeros (False for masks) along its first axis to length ``n``."""
    a = np.asarray(a)
    return np.concatenate([a, np.zeros((n - a.shape[0],) + a.shape[1:], dtype=a.dtype)]) if n > a.shape[0] else a


def _padded(contract, args):
    """The arguments with their independent rows, queries or keys padded; and how to cut the result back.

    Row-wise ops (a result ``[..., ...]``) get their leading axes flattened and padded: each row is
    computed alone, so the extra rows change nothing and are dropped.  Attention gets extra queries
    (at position 0) and extra keys past the last, which no query sees: zero weight, zero value.
    """
    if contract.out.startswith("..."):
        _, lead = contract.bind(*args)
        n = int(np.prod(lead, dtype=np.int64))
        rows = [a.kind in ("float", "index", "mask") and a.shape.startswith("...") for a in contract.args]
        padded = [_pad(np.reshape(v, (n,) + np.shape(v)[len(lead):]), _bucket(n)) if row else v
                  for row, v in zip(rows, args)]
        return padded, lambda out: out[:n].reshape(lead + out.shape[1:])
    if contract.name in ("causal_gqa", "sliding_gqa"):
        *head, pos, q, k, v = args
        S, L = q.shape[0], k.shape[0]
        keys = _bucket(L) if np.max(pos, initial=0) < L else L  # a query past the last key would see extra keys
        return [*head, _pad(pos, _bucket(S)), _pad(q, _bucket(S)), _pad(k, keys), _pad(v, keys)], lambda out: out[:S]
    return args, lambda out: out


def _wide(dtype):
    """The dtype for norms, angles and accumulation: float64 for float64, float32 otherwise."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# Basic


@_op()
def sigmoid(x):
    return jax.nn.sigmoid(x)


@_op()
def silu(x):
    return jax.nn.silu(x)


@_op()
def gelu_tanh(x):
    return _gelu(x)


def _gelu(x):
    # jax.nn.gelu on bf16/fp16 rounds tanh t to the dtype before 1 + tanh t (XLA on the CPU rounds each
    # op), which cancels the negative tail to 0 (bf16 below x = -3.5): computed in float32, as torch's
    # kernel and careful Flax engines do, and rounded once.
    return jax.nn.gelu(x.astype(_wide(x.dtype)), approximate=True).astype(x.dtype)


def _softcap(c, x):
    return c * jnp.tanh(x / c)


@_op()
def softcap(c, x):
    return _softcap(c, x)


# Norm


def _upcast(x):
    return x.astype(_wide(x.dtype))


def _mean_square(x):
    return jnp.mean(jnp.square(x), axis=-1, keepdims=True)


def _normalize(eps, x):
    """x / sqrt(mean(x^2) + eps) in the wide dtype."""
    x = _upcast(x)
    return x * lax.rsqrt(_mean_square(x) + eps)


@_op()
def rms(eps, x):
    return jnp.sqrt(_mean_square(_upcast(x))[..., 0] + eps).astype(x.dtype)


@_op()
def rmsnorm(eps, x, w):
    return (_normalize(eps, x) * _upcast(w)).astype(x.dtype)


@_op()
def rmsnorm_offset(eps, x, w):
    return (_normalize(eps, x) * (1 + _upcast(w))).astype(x.dtype)


@_op()
def rmsnorm_unit(eps, x):
    return _normalize(eps, x).astype(x.dtype)


@_op()
def rmsnorm_gated(eps, x, z, w):
    return (_upcast(w) * _normalize(eps, x) * jax.nn.silu(_upcast(z))).astype(x.dtype)


@_op()
def l2norm(eps, x):
    xf = _upcast(x)
    return (xf * lax.rsqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True) + eps)).astype(x.dtype)


# Rope


def _inv_freq(theta, denom, active, i, wide):
    freq = jnp.asarray(theta, wide) ** (-2 * i.astype(wide) / denom)
    return jnp.where(i < active, freq, 0)


@_op("dtype")
def inv_freq(theta, denom, active, i, dtype):
    dtype = jnp.dtype(dtype)
    return _inv_freq(theta, denom, active, i, _wide(dtype)).astype(dtype)


@_op("rot")
def rope(theta, rot, denom, active, pos, x):
    D, half = x.shape[-1], rot // 2
    if 2 * half > D:  # the spec reads partners beyond the head as 0: pad, rotate, cut back to D
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 2 * half - D)])
    wide = _wide(x.dtype)
    angle = pos.astype(wide)[..., None] * _inv_freq(theta, denom, active, jnp.arange(half), wide)
    cos, sin = jnp.cos(angle).astype(x.dtype), jnp.sin(angle).astype(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)[..., :D]


@_op("rot")
def rope_std(theta, rot, pos, x):
    return rope(theta, rot, rot, rot // 2, pos, x)


# Linear


def _linear(W, x):
    """x @ W.T with dtype inputs, accumulated in the wide dtype, cast back to the dtype."""
    y = jnp.einsum("...k,nk->...n", x, W, preferred_element_type=_wide(x.dtype))
    return y.astype(x.dtype)


@_op()
def linear(W, x):
    return _linear(W, x)


@_op()
def gate_up(Wg, Wu, x):
    return jnp.concatenate([_linear(Wg, x), _linear(Wu, x)], axis=-1)


@_op()
def silu_mul(gu):
    gate, up = jnp.split(gu, 2, axis=-1)
    return jax.nn.silu(gate) * up


@_op()
def gelu_mul(gu):
    gate, up = jnp.split(gu, 2, axis=-1)
    return _gelu(gate) * up


@_op()
def residual(r, x, h):
    return x + r * h


@_op()
def embed(c, E, tokens):
    return c * E[tokens]


@_op("cap")
def lm_head(mul, cap, W, x):
    logits = mul * _linear(W, x)
    return logits if cap is None else _softcap(cap, logits)


# Attention


def _softmax(s, visible):
    """Softmax over the last axis in the dtype of s; masked entries and empty rows are exactly 0."""
    return jax.nn.softmax(s, axis=-1, where=visible)


@_op()
def softmax(s, visible):
    return _softmax(s, visible)


def _gqa(scale, visible, q, k, v):
    """q [S,Hkv,G,D] against k, v [L,Hkv,D]; visible [S,L].  Query head c*G+g reads KV head c."""
    wide = _wide(q.dtype)
    logits = scale * jnp.einsum("scgd,lcd->scgl", q, k, preferred_element_type=wide)
    p = _softmax(logits.astype(q.dtype), visible[:, None, None, :])
    out = jnp.einsum("scgl,lcd->scgd", p, v, preferred_element_type=wide)
    return out.astype(q.dtype)


@_op()
def causal_gqa(scale, pos, q, k, v):
    p, l = pos[:, None], jnp.arange(k.shape[0])[None, :]
    return _gqa(scale, l <= p, q, k, v)


@_op()
def sliding_gqa(scale, window, pos, q, k, v):
    p, l = pos[:, None], jnp.arange(k.shape[0])[None, :]
    return _gqa(scale, (l <= p) & (p < l + window), q, k, v)


@_op()
def decode_gqa(scale, q, k, v):
    return causal_gqa(scale, jnp.array([k.shape[0] - 1]), q[None], k, v)[0]


@_op()
def sigmoid_gate(o, gate):
    return o * jax.nn.sigmoid(gate)


# ----------------------------------------------------------------------------------------- devices


def build() -> str:
    """This JAX's versions and the platforms it has, e.g. "jax 0.10.2, jaxlib 0.10.2, platforms: cpu"."""
    import jaxlib

    platforms = sorted({d.platform for d in jax.devices()})
    return f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, platforms: {', '.join(platforms)}"


def resolve_device(device: str):
    """``device`` as a JAX device that is there (``gpu`` is ``gpu:0``; ``cuda`` and ``rocm`` name the GPU
    too); ``DeviceError`` naming it and what JAX found otherwise."""
    kind, _, index = device.strip().lower().partition(":")
    platform = "gpu" if kind in ("cuda", "rocm") else kind
    if platform not in ("cpu", "gpu", "tpu") or (index and not index.isdigit()):
        raise DeviceError(f"jax cannot use the device {device!r}: its devices are cpu, gpu, gpu:N (cuda, rocm) "
                          f"and tpu")
    try:
        found = jax.devices(platform)
    except RuntimeError:
        found = []
    n = int(index or 0)
    if n >= len(found):
        seen = ", ".join(f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices())
        hint = "; a GPU needs a GPU jaxlib: pip install 'jax[cuda12]'" if platform == "gpu" else ""
        raise DeviceError(f"{device} not found: JAX sees {len(found)} {platform} device{'s' if len(found) != 1 else ''} "
                          f"(all devices: {seen}; {build()}{hint})")
    return found[n]


def _cuda_versions() -> dict:
    """CUDA runtime, cuDNN and driver API versions of a CUDA jaxlib (empty for others)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return {}
    if cuda_versions is None:
        return {}
    found = {}
    for key, getter in (("cuda_runtime", "cuda_runtime_get_version"), ("cudnn", "cudnn_get_version"),
                        ("cuda_driver_api", "cuda_driver_get_version")):
        try:
            found[key] = str(getattr(cuda_versions, getter)())
        except Exception:  # noqa: BLE001, S112 - a private module: report what it has
            continue
    return found


def device_environment(device) -> dict:
    """The device's name and the runtime versions that decide its kernels, for the report."""
    from gemma4_conformance.adapters.torch_backend import _nvidia_driver  # noqa: PLC0415 - only on a GPU

    env = {"device": f"{device.platform}:{device.id}", "device_name": device.device_kind, "library": build()}
    try:
        client = device.client
        env["runtime"] = client.platform_version
    except Exception:  # noqa: BLE001, S110 - a runtime's version only informs
        pass
    if device.platform == "gpu":
        env.update(_cuda_versions())
        env["driver"] = _nvidia_driver()
    return env


# ----------------------------------------------------------------------------------------- the adapter


class JaxAdapter:
    """The contract's numpy boundary around ``kernels`` (jitted ops): arrays go to ``device``, each op runs
    there under the adapter's matmul precision, and its result comes back as numpy in the dtype."""

    dtypes = DTYPES

    def __init__(self, kernels, name: str, device: str = "cpu", precision: str = PRECISION):
        self.kernels = kernels
        self.jax_device = resolve_device(device)
        self.device = f"{self.jax_device.platform}:{self.jax_device.id}"
        if precision != "inherit":
            try:
                with jax.default_matmul_precision(precision):  # JAX checks the value
                    pass
            except ValueError as e:
                raise ValueError(f"precision is inherit or a value of jax_default_matmul_precision: {e}") from None
        self.precision = precision
        self.name = name + ("" if precision == PRECISION else f"-precision-{precision}")
        self.transfer_seconds = 0.0

    def _precision(self):
        return jax.default_matmul_precision(self.precision) if self.precision != "inherit" else nullcontext()

    def _put(self, args, kinds) -> list:
        """The arrays of ``args`` on the device, in one transfer (a call per array cost more than most ops)."""
        arrays = [i for i, kind in enumerate(kinds) if kind in ("float", "index", "mask")]
        start = time.perf_counter()
        placed = jax.device_put([np.asarray(args[i]) for i in arrays], self.jax_device)
        self.transfer_seconds += time.perf_counter() - start
        args = list(args)
        for i, a in zip(arrays, placed):
            args[i] = a
        return args

    def _get(self, out) -> np.ndarray:
        out.block_until_ready()  # the op's own time is not a transfer
        start = time.perf_counter()
        array = np.asarray(out)
        self.transfer_seconds += time.perf_counter() - start
        return array

    def environment(self) -> dict:
        env = device_environment(self.jax_device)
        process = jax.config.jax_default_matmul_precision
        env["math_modes"] = {"jax_default_matmul_precision": "None (XLA's default)" if process is None else process,
                             "matmul_precision_of_this_backend": self.precision}
        env["math_modes_source"] = ("the process's jax_default_matmul_precision" if self.precision == "inherit" else
                                    f"jax.default_matmul_precision({self.precision!r}) around every op, overriding "
                                    f"the process's")
        effective = process if self.precision == "inherit" else self.precision
        env["math_summary"] = f"float32 matmul precision {effective or 'default'} (jax_default_matmul_precision)"
        env["compile_seconds"] = round(COMPILING["seconds"], 3)  # the process's, all jax backends' together
        env["persistent_cache_hits"] = COMPILING["persistent_cache_hits"]
        env["compilation_cache"] = jax.config.jax_compilation_cache_dir or "off"
        if hasattr(self.kernels, "environment"):
            env.update(self.kernels.environment())
        return env


def _contract_method(op: str):
    kinds = tuple(arg.kind for arg in CONTRACT[op].args)

    def method(self, *args, **kwargs):
        padded, unpad = _padded(CONTRACT[op], args)
        placed = self._put(padded, kinds)
        with self._precision():
            out = getattr(self.kernels, op)(*placed, **kwargs)
        result = unpad(self._get(out))
        MAP_BUDGET.tick()
        return result

    method.__name__ = method.__qualname__ = op
    method.__doc__ = f"``{op}`` of the contract, computed on the adapter's device."
    return method


for _op_name in OP_NAMES:
    setattr(JaxAdapter, _op_name, _contract_method(_op_name))

OPS = SimpleNamespace(**{op: globals()[op] for op in OP_NAMES})  # the jitted ops, for backends that reuse them


def _decode_gqa(self, scale, q, k, v, _kernel=JaxAdapter.decode_gqa):
    if self.kernels is not OPS:
        return _kernel(self, scale, q, k, v)
    # The jax backend decodes with its causal kernel's last row; asked as that row, its keys are padded.
    return self.causal_gqa(scale, np.array([np.shape(k)[0] - 1]), np.asarray(q)[None], k, v)[0]


JaxAdapter.decode_gqa = _decode_gqa


def backend(device: str = "cpu", precision: str = PRECISION) -> JaxAdapter:
    """The jax backend (``--backend=jax[precision=default]``, ...); see the module docstring."""
    adapter = JaxAdapter(OPS, "jax", device, precision)
    # Run-to-run invariance measured to hold on the CPU in float32 and bfloat16 (docs/invariance.md); not
    # measured on a GPU, nor for jax-sdpa's kernels: nothing is claimed there.
    adapter.invariance = frozenset({"run"}) if adapter.jax_device.platform == "cpu" else frozenset()
    return adapter
