"""llama.cpp (through llama-cpp-python) as a forward-only backend with a trace, and a serving session.

``--backend=llama.cpp`` or ``--backend='llama.cpp[kv=f32,fa=off]'``. Options:

* ``kv``: the KV cache type, ``f16`` (llama.cpp's default), ``f32``, ``bf16``, ``q8_0``, ``q4_0``.
* ``fa``: flash attention, ``auto`` (llama.cpp's default: on wherever the device supports it, which
  the CPU does, so the default run *is* flash attention), ``on`` or ``off``.
* ``threads``: CPU threads (default: all); ``cache_dir``: where converted GGUF files go (default
  ``$GEMMA4_CONFORMANCE_CACHE`` or ``~/.cache/gemma4-conformance``); ``source``: the llama.cpp source
  tree whose converter is used (default ``$LLAMA_CPP_SOURCE``, else the tree ``fetch-converter``
  stored in the cache, see below).
* ``weights``: ``q8_0``, ``q4_0``, ``q4_k`` or ``q6_k`` (``OP_WEIGHTS``): the op tests' weight format (below).

The adapter's name carries the settings (``llama.cpp-kv_f16-fa_auto``), so two settings of the
engine are two backends in a run, its report and its deviations file.

**Weights.** The checkpoint folder the forward contract passes is converted with llama.cpp's own
converter (``convert_hf_to_gguf.py``'s classes, ``llama_cpp_convert.py``) to an F32, BF16 or F16
GGUF for the dtype under test (float32, bfloat16, float16), once per checkpoint and type: the file is
kept in the cache folder under a key made of the checkpoint's contents (files up to 256 MB hashed
whole, larger ones by path, size and mtime: a 12B conversion writes tens of GB, so it is done once)
and the converter's version. The converter keeps norm weights, the layer scalars and the RoPE
frequency factors in float32 in every type, and stores norm weights as ``w`` (Gemma 4), not
``1 + w`` as for Gemma 3.

**Precision.** Whatever the GGUF type, llama.cpp keeps activations in float32: a "bf16" run is
bf16 weights with float32 activations, and each matrix product rounds its activation input to the
weight's type (ggml's ``vec_dot_type``: bf16 for BF16 weights, f16 for F16) and accumulates in
float32. So in bfloat16 and float16 it is judged against a plain same-dtype engine that rounds every
op's output to the dtype, which it should beat; the verdict says it is *at least* as accurate as a
plain engine in that dtype, not that it computes in it. Keys and values are rounded to the cache
type when stored, and attention reads them from the cache.

**Logits.** Every position's logits: each token of the batch asks for its output
(``llama_batch.logits[i] = 1``), read with ``llama_get_logits`` as float32 ``[T, V]``.

**Trace.** llama.cpp's scheduler calls an evaluation callback (``cb_eval``, what its
``llama-eval-callback`` tool uses) for every tensor of the graph; the adapter asks for the tensors
below, copies them as computed, and maps llama.cpp's names (``src/models/gemma4.cpp``, llama.cpp
0c1e570 as vendored by llama-cpp-python 0.3.36; ``-{i}`` is the layer) to the spec's nodes:

=========================  ============================================================================
graph node                 llama.cpp tensor
=========================  ============================================================================
embed                      ``inp_scaled``: the embedding rows times ``sqrtf(n_embd)`` in float32
input_layernorm            ``attn_norm-i``
q_proj, q_norm, q_rope     ``Qcur-i``, ``Qcur_normed-i``, ``Qcur_pos-i`` (RoPE: NEOX, rotate-half pairs)
k_proj                     ``Kcur-i``; on full layers ``Vcur-i``, which *is* that tensor (v = k, the
                           second name given to the same tensor replaces the first)
v_proj                     ``Vcur-i`` (sliding layers)
k_norm, k_rope, v_norm     ``Kcur_normed-i``, ``Kcur_pos-i``, ``Vcur_normed-i`` (rms_norm, no weight)
attention                  ``kqv_out-i``, before the output projection (soft_max or flash_attn_ext,
                           on keys and values as read back from the cache)
o_proj                     not named: the matrix product feeding the rms_norm of ``attn_post_norm-i``
post_attention_layernorm   ``attn_post_norm-i``
attention_residual         ``attn_out-i`` (llama.cpp's "attn_out" is the residual sum)
pre_feedforward_layernorm  ``ffn_norm-i``
gate_up                    ``ffn_gate-i`` and ``ffn_up-i``, joined gate first
geglu                      ``ffn_geglu-i``
down_proj                  ``ffn_out-i``
post_feedforward_layernorm ``ffn_post_norm-i``
mlp_residual               not named: the sum that ``l_out-i`` multiplies by the layer scalar
layer_scalar               ``l_out-i`` (``out_scaled-i``, renamed by the control-vector hook)
final_norm, logits         ``result_norm``, ``result_output`` (softcap: scale, tanh, scale)
=========================  ============================================================================

A tensor llama.cpp does not produce under these names is left out of the trace ("not traced"). The
adapter never asks for a bare rms_norm that a multiplication follows: asking splits the graph there,
which would stop the CPU backend fusing rms_norm with its weight's multiplication, and the traced
run would not be the run the logits come from. ``hidden_states`` are the ``l_out-i`` tensors.

**Op tests** (``linear``, ``gate_up``, ``lm_head``; docs/engines.md): with ``weights=F`` the op tests hand W as
a ``QuantizedWeight`` in F, whose blocks ggml's CPU backend multiplies as llama.cpp's forward does
(``Products``); the adapter declares ``{"weights": F, "activations": A}``, A what llama.cpp rounds x to for F
(``op_formats``).  The declaration then holds for the forward and the session too: a quantized GGUF that does
not hold F's blocks or rounds x otherwise is refused, a float GGUF runs (it rounds nothing declared).  Without
the option the op methods still compute a QuantizedWeight, and refuse what they cannot (``Unsupported``).

**Session** (the serving contract): one llama.cpp context whose unified KV cache holds every live
sequence; each ``step`` is one batch in which every token carries its sequence's slot id and
position, with every position's logits; ``release`` removes the slot's cells
(``llama_memory_seq_rm``) and frees the slot for the next sequence.  ``traced_step`` is a step that also
returns each sequence's rows of every node (the trace above, per step), so that a broken invariance
relation names the node where the bits part.

**Setup.** ``pip install 'gemma4-conformance[llama-cpp]'`` builds llama-cpp-python from source (CPU
only: about an hour on 2 busy cores). Its wheel does not ship the converter, so fetch the source tree
of the same version once: ``python -m gemma4_conformance.adapters.llama_cpp_backend fetch-converter``
(pip downloads llama-cpp-python's sdist; its ``vendor/llama.cpp`` is kept in the cache folder).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gemma4_conformance.adapters.contract import Unsupported
from gemma4_conformance.checkpoints.checkpoint import refuse_quantized
from gemma4_conformance.checkpoints.config import TextConfig
from gemma4_conformance.checkpoints.gguf_file import GGUF_NAME, GGUFExportError, export
from gemma4_conformance.checkpoints.quantized import WEIGHT_FORMATS, QuantizedWeight
from gemma4_conformance.spec import format_of

DTYPES = ("float32", "bfloat16", "float16")
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
KV_TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0")
FLASH_ATTENTION = ("auto", "on", "off")
DEFAULTS = {"kv": "f16", "fa": "auto"}  # llama_context_default_params() of llama.cpp 0c1e570
HASHED_WHOLE = 256 * 2**20  # checkpoint files up to this size are hashed whole for the cache key
SOURCE_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # what the converter needs of the tree

# llama.cpp's per-layer tensor names -> the graph's layer nodes (module docstring).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "Qcur": "q_proj",
    "Qcur_normed": "q_norm",
    "Qcur_pos": "q_rope",
    "Kcur": "k_proj",
    "Vcur": "v_proj",
    "Kcur_normed": "k_norm",
    "Kcur_pos": "k_rope",
    "Vcur_normed": "v_norm",
    "kqv_out": "attention",
    "attn_post_norm": "post_attention_layernorm",
    "attn_out": "attention_residual",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "gate_up",
    "ffn_up": "gate_up",
    "ffn_geglu": "geglu",
    "ffn_out": "down_proj",
    "ffn_post_norm": "post_feedforward_layernorm",
    "l_out": "layer_scalar",
}
# The format ggml's CPU backend rounds a product's input x to before multiplying it with a weight of each
# block type: that type's ``vec_dot_type`` in ``type_traits_cpu`` (ggml/src/ggml-cpu/ggml-cpu.c of the
# llama.cpp that llama-cpp-python 0.3.36 vendors: Q4_0 and Q8_0 -> GGML_TYPE_Q8_0, Q4_K and Q6_K ->
# GGML_TYPE_Q8_K); the products are then integer dot products of the blocks.  What the adapter declares
# as its ``activations`` (``declared_activations``, docs/engines.md).
VEC_DOT_TYPES = {"Q4_0": "q8_0", "Q8_0": "q8_0", "Q4_K": "q8_k", "Q6_K": "q8_k"}
GLOBAL_TENSORS = {"inp_scaled": "embed", "result_norm": "final_norm", "result_output": "logits"}
_LAYER_NAME = re.compile(r"^(?P<base>[A-Za-z_]+)-(?P<layer>\d+)$")


class SetupError(RuntimeError):
    """llama.cpp cannot run here as configured: the message says what to install or set."""


# ---- the trace: llama.cpp's graph tensors -> the spec's nodes (pure: tested with fakes) -----------

@dataclass(frozen=True)
class GraphTensor:
    """A tensor of llama.cpp's graph as the evaluation callback sees it (``id``: its address)."""

    id: int
    name: str
    op: str  # ggml_op_name: "MUL_MAT", "ADD", "RMS_NORM", "MUL", "FLASH_ATTN_EXT", ...
    shape: tuple[int, ...]  # numpy order: ggml's ne reversed, leading 1s dropped down to 2 axes ([T, H], [T, H, D])
    srcs: tuple[int, ...]  # ids of its sources


@dataclass
class TraceCollector:
    """Decides which tensors to copy while llama.cpp computes, and maps them to the graph's nodes."""

    config: TextConfig
    tensors: dict[int, GraphTensor] = field(default_factory=dict)  # every tensor asked about
    data: dict[int, np.ndarray] = field(default_factory=dict)  # the copied ones

    def wants(self, t: GraphTensor) -> bool:
        """Whether to copy ``t`` (the callback's ``ask``): a named node, or a matrix product or sum of
        the residual stream's shape, which may turn out to be o_proj or the MLP residual (unnamed)."""
        self.tensors[t.id] = t
        if _node_of(t.name) is not None:
            return True
        return t.op in ("MUL_MAT", "ADD") and len(t.shape) == 2 and t.shape[-1] == self.config.hidden_size

    def take(self, tensor_id: int, values: np.ndarray) -> None:
        self.data[tensor_id] = np.array(values, copy=True)

    @property
    def flash_attention(self) -> bool:
        return any(t.op == "FLASH_ATTN_EXT" for t in self.tensors.values())

    def trace(self) -> dict[str, np.ndarray]:
        """Graph node -> the engine's array, for every node llama.cpp produced (module docstring)."""
        by_name = {t.name: t for t in self.tensors.values() if t.id in self.data}
        out: dict[str, np.ndarray] = {}
        for name, node in GLOBAL_TENSORS.items():
            if name in by_name:
                out[node] = self._array(by_name[name])
        for layer in self.config.layers:
            i = layer.index

            def get(base):
                t = by_name.get(f"{base}-{i}")
                return None if t is None else self._array(t)

            found = {}
            for base, node in LAYER_TENSORS.items():
                if node not in ("gate_up", "k_proj", "v_proj"):
                    found[node] = get(base)
            if layer.k_eq_v:  # no v_proj; llama.cpp's Vcur-i is the k projection itself
                found["k_proj"] = get("Kcur") if get("Kcur") is not None else get("Vcur")
            else:
                found["k_proj"], found["v_proj"] = get("Kcur"), get("Vcur")
            gate, up = get("ffn_gate"), get("ffn_up")
            if gate is not None and up is not None:
                found["gate_up"] = np.concatenate([gate, up], axis=-1)
            found["o_proj"] = self._unnamed_source(by_name.get(f"attn_post_norm-{i}"), "RMS_NORM", "MUL_MAT")
            found["mlp_residual"] = self._unnamed_source(by_name.get(f"l_out-{i}"), None, "ADD")
            for node, value in found.items():
                if value is not None:
                    out[f"layers.{i}.{node}"] = value
        return out

    def _array(self, t: GraphTensor) -> np.ndarray:
        return self.data[t.id].reshape(t.shape)

    def _unnamed_source(self, t: GraphTensor | None, through: str | None, op: str) -> np.ndarray | None:
        """The copied source of ``t`` of op ``op``, looking through one source of op ``through`` first
        (o_proj: attn_post_norm = rms_norm(o) * w; the MLP residual: l_out = residual * scalar)."""
        if t is None:
            return None
        sources = [self.tensors.get(s) for s in t.srcs]
        if through is not None:
            inner = [s for s in sources if s is not None and s.op == through]
            if len(inner) != 1:
                return None
            sources = [self.tensors.get(s) for s in inner[0].srcs]
        hits = [s for s in sources if s is not None and s.op == op and s.id in self.data]
        return self._array(hits[0]) if len(hits) == 1 else None


def _node_of(name: str) -> str | None:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    m = _LAYER_NAME.match(name)
    return LAYER_TENSORS.get(m["base"]) if m else None


# ---- the converter and the GGUF cache --------------------------------------------------------------

def default_cache_dir() -> Path:
    return Path(os.environ.get("GEMMA4_CONFORMANCE_CACHE") or Path.home() / ".cache" / "gemma4-conformance")


def library_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise SetupError("llama-cpp-python is not installed: pip install 'gemma4-conformance[llama-cpp]' "
                         "(it builds llama.cpp from source, CPU only; about an hour on 2 cores)") from None


def fetched_source(cache_dir: Path, version: str) -> Path:
    return cache_dir / "llama.cpp" / f"source-{version}"


def find_source(source: str | None, cache_dir: Path) -> Path:
    """The llama.cpp tree whose converter converts: ``source``, $LLAMA_CPP_SOURCE or the fetched one."""
    chosen = source or os.environ.get("LLAMA_CPP_SOURCE") or fetched_source(cache_dir, library_version())
    path = Path(chosen).expanduser()
    missing = [name for name in SOURCE_FILES if not (path / name).exists()]
    if missing:
        raise SetupError(f"llama.cpp's converter is not in {path} (missing {', '.join(missing)}): run "
                         f"`python -m gemma4_conformance.adapters.llama_cpp_backend fetch-converter` once (it keeps "
                         f"the llama.cpp tree of the installed llama-cpp-python in the cache folder), or pass "
                         f"source=/path/to/llama.cpp or set LLAMA_CPP_SOURCE")
    return path


def fetch_converter(cache_dir: Path | None = None) -> Path:
    """Download llama-cpp-python's sdist of the installed version and keep its llama.cpp converter."""
    cache_dir = cache_dir or default_cache_dir()
    version = library_version()
    target = fetched_source(cache_dir, version)
    if all((target / name).exists() for name in SOURCE_FILES):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"{archive.name[:-len('.tar.gz')]}/vendor/llama.cpp/"
        staging = target.with_name(target.name + ".partial")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].split("/")[0] in SOURCE_FILES]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(staging, members=members, filter="data")
        staging.replace(target)
    return target


def checkpoint_fingerprint(folder: Path) -> str:
    """A key for a checkpoint folder's contents: small files hashed whole, large ones by path, size, mtime."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors",
                                                                                     ".model")):
        stat = file.stat()
        digest.update(file.name.encode() + b"\0")
        if stat.st_size <= HASHED_WHOLE:
            digest.update(file.read_bytes())
        else:
            digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def converter_fingerprint(source: Path) -> str:
    digest = hashlib.sha256(Path(__file__).with_name("llama_cpp_convert.py").read_bytes())
    for relative in ("conversion/base.py", "conversion/gemma.py", "gguf-py/gguf/constants.py"):
        file = source / relative
        digest.update(file.read_bytes() if file.is_file() else relative.encode())
    return digest.hexdigest()


@dataclass
class Conversion:
    gguf: Path
    seconds: float | None  # None: found in the cache


def convert(checkpoint: Path, dtype: str, cache_dir: Path, source: Path, outtype: str | None = None) -> Conversion:
    """The GGUF of ``checkpoint`` for ``dtype`` (or of the converter's ``outtype``), converted now or found in
    the cache."""
    refuse_quantized(checkpoint, "llama.cpp's converter")
    outtype = outtype or GGUF_TYPES[dtype]
    key = hashlib.sha256(f"{checkpoint_fingerprint(checkpoint)}:{converter_fingerprint(source)}".encode()).hexdigest()
    folder = cache_dir / "llama.cpp"
    target = folder / f"{key[:24]}-{outtype}.gguf"
    if target.is_file():
        return Conversion(target, None)
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "gemma4_conformance.adapters.llama_cpp_convert", str(source),
                          str(checkpoint), str(partial), outtype], capture_output=True, text=True)
    if run.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-12:])
        raise RuntimeError(f"llama.cpp's converter failed on {checkpoint} ({outtype}):\n{tail}")
    partial.replace(target)
    seconds = time.perf_counter() - start
    target.with_suffix(".json").write_text(json.dumps({
        "checkpoint": str(checkpoint), "outtype": outtype, "source": str(source), "seconds": round(seconds, 1),
        "llama-cpp-python": library_version()}, indent=1))
    return Conversion(target, seconds)


QUANTIZED = {"q8_0": "the converter's --outtype q8_0",
             "q4_k_m": "llama_model_quantize (LLAMA_FTYPE_MOSTLY_Q4_K_M) of the F32 conversion"}


def quantize(checkpoint: Path, kind: str, folder: Path, cache_dir: Path, source: Path) -> Path:
    """A GGUF of ``checkpoint`` quantized by llama.cpp (``QUANTIZED``), exported with its exact weights to the
    checkpoint folder ``folder`` (checkpoints/gguf_file.py): ``--weights=folder`` judges llama.cpp on that GGUF
    against a reference that runs on the same numbers."""
    if kind not in QUANTIZED:
        raise ValueError(f"quantize: {kind!r} is not one of {', '.join(QUANTIZED)}")
    if kind == "q8_0":
        gguf_path = convert(checkpoint, "float32", cache_dir, source, outtype="q8_0").gguf
    else:
        lib = Library.get()
        L = lib.L
        f32 = convert(checkpoint, "float32", cache_dir, source).gguf
        gguf_path = f32.with_name(f32.stem + f"-{kind}.gguf")
        if not gguf_path.is_file():
            params = L.llama_model_quantize_default_params()
            params.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_K_M
            partial = gguf_path.with_suffix(f".partial-{os.getpid()}")
            if L.llama_model_quantize(str(f32).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
                partial.unlink(missing_ok=True)
                raise RuntimeError(f"llama_model_quantize failed on {f32} ({kind}):\n{lib.log_tail()}")
            partial.replace(gguf_path)
    return export(gguf_path, checkpoint, folder)


# ---- the library through ctypes ------------------------------------------------------------------

class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of ggml.h (GGML_MAX_DIMS 4, GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
_ELEMENT = {0: np.dtype(np.float32), 1: np.dtype(np.float16)}  # bf16 (30) added at load (ml_dtypes)


class Library:
    """llama-cpp-python's low-level API, loaded once: backend initialised, logs kept (last 200 lines)."""

    _instance = None

    def __init__(self):
        import ml_dtypes
        import llama_cpp
        from llama_cpp import _ggml

        self.L = llama_cpp
        self.ggml = _ggml.libggml
        self.ggml.ggml_op_name.restype = ctypes.c_char_p
        self.ggml.ggml_op_name.argtypes = [ctypes.c_int]
        self.ggml.ggml_backend_buffer_is_host.restype = ctypes.c_bool
        self.ggml.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
        _ELEMENT[GGML_TYPES["bf16"]] = np.dtype(ml_dtypes.bfloat16)
        self.log: deque[str] = deque(maxlen=200)
        self._log_callback = llama_cpp.llama_log_callback(self._keep_log)
        llama_cpp.llama_log_set(self._log_callback, None)
        llama_cpp.llama_backend_init()
        self.version = library_version()
        self._op_names: dict[int, str] = {}

    @classmethod
    def get(cls) -> "Library":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _keep_log(self, level, text, user_data):
        self.log.append(text.decode(errors="replace").rstrip("\n"))

    def log_tail(self, n: int = 12) -> str:
        return "\n".join(line for line in list(self.log)[-n:] if line.strip())

    def op_name(self, op: int) -> str:
        if op not in self._op_names:
            self._op_names[op] = self.ggml.ggml_op_name(op).decode()
        return self._op_names[op]

    def graph_tensor(self, t: GgmlTensor, address: int) -> GraphTensor:
        shape = list(reversed(t.ne))
        while len(shape) > 2 and shape[0] == 1:
            shape.pop(0)
        return GraphTensor(address, t.name.decode(errors="replace"), self.op_name(t.op), tuple(shape),
                           tuple(s for s in t.src if s))

    def values(self, t: GgmlTensor) -> np.ndarray | None:
        """A computed tensor's values in numpy order (strided views gathered), or None when unreadable."""
        element = _ELEMENT.get(t.type)
        if element is None or not t.data or (t.buffer and not self.ggml.ggml_backend_buffer_is_host(t.buffer)):
            return None
        ne, nb = list(t.ne), list(t.nb)
        span = sum((n - 1) * stride for n, stride in zip(ne, nb)) + element.itemsize
        base = np.frombuffer((ctypes.c_char * span).from_address(t.data), dtype=element)
        strided = np.lib.stride_tricks.as_strided(base, shape=tuple(reversed(ne)), strides=tuple(reversed(nb)))
        return np.array(strided, dtype=np.float32)


def block_types(gguf_path: Path) -> set[str]:
    """The block types (VEC_DOT_TYPES' keys) of the GGUF ``gguf_path``'s tensors; none for a float GGUF."""
    import gguf

    return {t.tensor_type.name for t in gguf.GGUFReader(gguf_path).tensors if t.tensor_type.name in VEC_DOT_TYPES}


def declared_activations(gguf_path: Path, types: set[str] | None = None) -> dict[str, str]:
    """The ``formats`` llama.cpp's CPU products have on the GGUF ``gguf_path`` (whose ``block_types`` are
    ``types`` where given): ``{"activations": f}``, f the ``vec_dot_type`` of its block types (VEC_DOT_TYPES),
    ``{}`` for a float GGUF.  A GGUF whose block types round x to both q8_0 and q8_K is refused: a declaration
    is the adapter's, not a tensor's."""
    by_format: dict[str, set[str]] = {}
    for name in block_types(gguf_path) if types is None else types:
        by_format.setdefault(VEC_DOT_TYPES[name], set()).add(name)
    if len(by_format) > 1:
        mixed = "; ".join(f"{', '.join(sorted(types))} round x to {fmt}" for fmt, types in sorted(by_format.items()))
        raise ValueError(f"{gguf_path} mixes block types whose products round their input to different formats "
                         f"({mixed}): the suite declares one activation format per adapter, so it cannot judge "
                         f"this GGUF's products (quantize it to one family: Q8_0/Q4_0, or K-quants)")
    return {"activations": fmt for fmt in by_format}


class Model:
    """A loaded GGUF (``llama_model``), shared by an adapter's forwards and sessions; ``block_types``: its
    quantized tensors' types; ``formats``: what its products round beyond the dtype under test
    (``declared_activations``)."""

    def __init__(self, lib: Library, path: Path):
        L = lib.L
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        self.lib, self.path = lib, path
        self.block_types = block_types(path)
        self.formats = declared_activations(path, self.block_types)
        self.ptr = L.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not load {path}:\n{lib.log_tail()}")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.ptr))

    def close(self):
        if self.ptr:
            self.lib.L.llama_model_free(self.ptr)
            self.ptr = None


class Context:
    """A llama.cpp context of ``n_ctx`` cells (one unified KV cache for up to ``sequences`` sequences),
    with the adapter's cache type and flash-attention setting; ``collector`` gets the evaluation callback."""

    def __init__(self, model: Model, adapter: "LlamaCpp", n_ctx: int, sequences: int, n_ubatch: int,
                 collector: TraceCollector | None = None, traceable: bool = False):
        lib = model.lib
        L = lib.L
        params = L.llama_context_default_params()
        params.n_ctx = params.n_batch = n_ctx
        params.n_ubatch = n_ubatch
        params.n_seq_max = sequences
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = adapter.threads
        params.type_k = params.type_v = GGML_TYPES[adapter.kv]
        params.flash_attn_type = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                  "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}[adapter.fa]
        self.collector, self.error = collector, None
        if collector is not None or traceable:
            # With the callback installed and no collector, every tensor is declined, and ggml's scheduler then
            # computes each split whole, as it does without a callback: a traceable session's untraced steps
            # are its plain steps (tests/test_llama_cpp.py checks it).
            self._callback = L.ggml_backend_sched_eval_callback(self._evaluated)  # kept: ctypes does not
            params.cb_eval = self._callback
        self.model, self.lib, self.n_batch, self.n_ubatch = model, lib, n_ctx, n_ubatch
        self.ptr = L.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not create a context ({adapter.name}, {n_ctx} cells):\n"
                               f"{lib.log_tail()}")

    def _evaluated(self, address, ask, user_data):
        try:
            if self.collector is None:
                return not ask
            t = GgmlTensor.from_address(address)
            if ask:
                return self.collector.wants(self.lib.graph_tensor(t, address))
            values = self.lib.values(t)
            if values is not None:
                self.collector.take(address, values)
            return True
        except BaseException as e:  # an exception cannot cross the C callback: keep it, stop the compute
            self.error = e
            return False

    def decode(self, tokens, positions, seqs) -> np.ndarray:
        """Logits ``[n, V]`` (float32) of every token of one batch: token i at ``positions[i]`` of ``seqs[i]``."""
        L, n = self.lib.L, len(tokens)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i in range(n):
                batch.token[i], batch.pos[i] = int(tokens[i]), int(positions[i])
                batch.n_seq_id[i], batch.logits[i] = 1, 1
                batch.seq_id[i][0] = int(seqs[i])
            status = L.llama_decode(self.ptr, batch)
            if self.error is not None:
                raise self.error
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}:\n{self.lib.log_tail()}")
            V = self.model.vocab
            return np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(self.ptr, i), shape=(V,)).copy()
                             for i in range(n)]) if n else np.zeros((0, V), np.float32)
        finally:
            L.llama_batch_free(batch)

    def remove(self, seq: int) -> None:
        L = self.lib.L
        L.llama_memory_seq_rm(L.llama_get_memory(self.ptr), seq, -1, -1)

    def close(self):
        if self.ptr:
            self.lib.L.llama_free(self.ptr)
            self.ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cells(n: int) -> int:
    return max(256, -(-n // 256) * 256)


# ---- op level: ggml's matrix product on quantized weights ------------------------------------------

class InitParams(ctypes.Structure):
    """``struct ggml_init_params`` of ggml.h."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_P, _SIZE, _INT = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
# The ggml functions the products call: (result, arguments), as ggml.h, ggml-alloc.h, ggml-backend.h and
# ggml-cpu.h declare them in the headers llama-cpp-python 0.3.36 installs (site-packages/include).  ctypes
# finds them all through libggml, which links libggml-base and libggml-cpu.
_PRODUCT_FUNCTIONS = {
    "ggml_init": (_P, [InitParams]),
    "ggml_free": (None, [_P]),
    "ggml_tensor_overhead": (_SIZE, []),
    "ggml_graph_overhead": (_SIZE, []),
    "ggml_type_name": (ctypes.c_char_p, [_INT]),
    "ggml_blck_size": (ctypes.c_int64, [_INT]),
    "ggml_type_size": (_SIZE, [_INT]),
    "ggml_nbytes": (_SIZE, [_P]),
    "ggml_new_tensor_2d": (_P, [_P, _INT, ctypes.c_int64, ctypes.c_int64]),
    "ggml_mul_mat": (_P, [_P, _P, _P]),
    "ggml_scale": (_P, [_P, _P, ctypes.c_float]),
    "ggml_tanh": (_P, [_P, _P]),
    "ggml_new_graph": (_P, [_P]),
    "ggml_build_forward_expand": (None, [_P, _P]),
    "ggml_backend_dev_by_type": (_P, [_INT]),
    "ggml_backend_dev_backend_reg": (_P, [_P]),
    "ggml_backend_reg_get_proc_address": (_P, [_P, ctypes.c_char_p]),
    "ggml_backend_dev_buffer_type": (_P, [_P]),
    "ggml_backend_dev_supports_op": (ctypes.c_bool, [_P, _P]),
    "ggml_backend_buft_name": (ctypes.c_char_p, [_P]),
    "ggml_backend_buft_alloc_buffer": (_P, [_P, _SIZE]),
    "ggml_backend_buffer_free": (None, [_P]),
    "ggml_backend_alloc_ctx_tensors_from_buft": (_P, [_P, _P]),
    "ggml_backend_tensor_set": (None, [_P, _P, _SIZE, _SIZE]),
    "ggml_backend_tensor_get": (None, [_P, _P, _SIZE, _SIZE]),
    "ggml_backend_graph_compute": (_INT, [_P, _P]),
    "ggml_backend_cpu_init": (_P, []),
    "ggml_backend_cpu_set_n_threads": (None, [_P, _INT]),
    "ggml_backend_free": (None, [_P]),
}
DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_CPU
_EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(_P), _P)  # ggml_backend_dev_get_extra_bufts_t
# The weight formats whose products llama.cpp's op tests run: GGUF's block types, each rounding x to its
# vec_dot_type (VEC_DOT_TYPES); what the option ``weights`` takes.
OP_WEIGHTS = tuple(name for name, f in WEIGHT_FORMATS.items() if f.ggml_type in VEC_DOT_TYPES)


def op_formats(weights: str) -> dict[str, str]:
    """What an adapter whose op tests hand it ``weights`` blocks declares: the weights, and the format llama.cpp's
    CPU products round x to for them (VEC_DOT_TYPES)."""
    return {"weights": weights, "activations": VEC_DOT_TYPES[WEIGHT_FORMATS[weights].ggml_type]}


class Products:
    """ggml's matrix product ``ggml_mul_mat(W, x)`` of a quantized weight and float32 x, computed by ggml's CPU
    backend as llama.cpp's CPU forward computes it (docs/engines.md, "Op tests on quantized weights").

    W is a 2-D tensor of its GGML block type holding the blocks' bytes as stored (GGUF's layout, row by row),
    in the buffer type llama.cpp's model loader would put it in: the first of the CPU device's extra buffer
    types (``ggml_backend_dev_get_extra_bufts``: here CPU_REPACK, which interleaves Q4_0 and Q4_K weights of
    a multiple of 8 rows for AVX2's GEMM kernels) whose device supports the product with W there, else the
    plain CPU buffer; that is ``select_weight_buft`` of src/llama-model-loader.cpp, down to its probe with an
    empty buffer (loading a Q4_K_M GGUF, llama.cpp logs "repack tensor ... with q4_K_8x8" for the same
    weights).  x is an F32 tensor ``[T, K]``, the graph computes on the CPU backend with the adapter's
    threads, the F32 result ``[T, N]`` is read back, and every context and buffer is freed before returning."""

    def __init__(self, lib: Library, threads: int):
        g = lib.ggml
        for name, (result, arguments) in _PRODUCT_FUNCTIONS.items():
            function = getattr(g, name)
            function.restype, function.argtypes = result, arguments
        self.g, self.lib = g, lib
        self.types = self._types()
        self.device = g.ggml_backend_dev_by_type(DEVICE_TYPE_CPU)
        if not self.device:
            raise SetupError("ggml has no CPU device: llama-cpp-python's libggml-cpu did not register")
        get_extra = g.ggml_backend_reg_get_proc_address(g.ggml_backend_dev_backend_reg(self.device),
                                                        b"ggml_backend_dev_get_extra_bufts")
        extra = _EXTRA_BUFTS(get_extra)(self.device) if get_extra else None
        self.buffer_types = []
        while extra and extra[len(self.buffer_types)]:
            self.buffer_types.append(extra[len(self.buffer_types)])
        self.buffer_types.append(g.ggml_backend_dev_buffer_type(self.device))
        self.backend = g.ggml_backend_cpu_init()
        g.ggml_backend_cpu_set_n_threads(self.backend, threads)
        self._placed: dict[tuple[int, int, int], int] = {}  # (type, K, N) -> the buffer type W goes in

    def _types(self) -> dict[str, int]:
        """OP_WEIGHTS' formats -> their number in enum ggml_type: GGUF's (the ``gguf`` package's
        GGMLQuantizationType), checked against the installed ggml's name, block size and block bytes for it."""
        import gguf

        g, types = self.g, {}
        for fmt in OP_WEIGHTS:
            f = WEIGHT_FORMATS[fmt]
            number = gguf.GGMLQuantizationType[f.ggml_type].value
            found = (g.ggml_type_name(number).decode().upper(), g.ggml_blck_size(number), g.ggml_type_size(number))
            if found != (f.ggml_type, f.block, f.block_bytes):
                raise SetupError(f"the installed ggml's type {number} is {found[0]} of {found[1]} values in {found[2]} "
                                 f"bytes, not GGUF's {f.ggml_type} ({f.block} in {f.block_bytes}): its "
                                 f"llama-cpp-python is not the version the adapter binds")
            types[fmt] = number
        return types

    def buffer_type(self, product: int, weight: int, key: tuple[int, int, int]) -> int:
        """The buffer type llama.cpp's loader gives ``weight``, of the tensor ``product``: the first whose
        device supports the product with the weight in an empty buffer of it (``key``: its type, K, N)."""
        if key not in self._placed:
            g, tensor = self.g, GgmlTensor.from_address(weight)
            for buffer_type in self.buffer_types:
                probe = g.ggml_backend_buft_alloc_buffer(buffer_type, 0)
                tensor.buffer = probe
                try:
                    supported = g.ggml_backend_dev_supports_op(self.device, product)
                finally:
                    tensor.buffer = None
                    g.ggml_backend_buffer_free(probe)
                if supported:
                    self._placed[key] = buffer_type
                    break
            else:
                raise RuntimeError(f"ggml's CPU device supports no buffer type for a product with a "
                                   f"{g.ggml_type_name(key[0]).decode()} weight [{key[2]}, {key[1]}]")
        return self._placed[key]

    def buffer_name(self, fmt: str, N: int, K: int) -> str:
        """The buffer type a ``[N, K]`` weight in ``fmt`` is placed in (CPU_REPACK or CPU): which kernel runs."""
        x = np.zeros((1, K), np.float32)
        self(QuantizedWeight(fmt, np.zeros(WEIGHT_FORMATS[fmt].stored_shape((N, K)), np.uint8), (N, K)), x)
        return self.g.ggml_backend_buft_name(self._placed[(self.types[fmt], K, N)]).decode()

    def __call__(self, W: QuantizedWeight, x: np.ndarray, mul: float | None = None,
                 cap: float | None = None) -> np.ndarray:
        """``[T, N]`` float32: ggml_mul_mat(W, x), x float32 ``[T, K]``; then, as llama.cpp's Gemma graph
        builds the logits (src/models/gemma4.cpp), ``ggml_scale`` by ``mul`` where it is given (Gemma's graph
        has none: 1) and, with a ``cap``, ggml_scale(1 / cap), ggml_tanh, ggml_scale(cap), in float32."""
        g = self.g
        N, K = W.shape
        T = len(x)
        number = self.types[W.format]
        stored = np.ascontiguousarray(W.stored, dtype=np.uint8)
        if stored.shape != WEIGHT_FORMATS[W.format].stored_shape((N, K)) or x.shape != (T, K):
            raise ValueError(f"a {W.format} weight [{N}, {K}] stored as {list(stored.shape)} bytes and x "
                             f"{list(x.shape)}: the blocks or x do not fit the matrix")
        if T == 0:
            return np.zeros((0, N), np.float32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        overhead = g.ggml_tensor_overhead()
        weights_ctx = g.ggml_init(InitParams(overhead, None, True))
        graph_ctx = g.ggml_init(InitParams(8 * overhead + g.ggml_graph_overhead(), None, True))
        buffers = []
        try:
            if not weights_ctx or not graph_ctx:
                raise MemoryError("ggml_init could not allocate a context's metadata")
            weight = g.ggml_new_tensor_2d(weights_ctx, number, K, N)
            inputs = g.ggml_new_tensor_2d(graph_ctx, GGML_TYPES["f32"], K, T)
            product = out = g.ggml_mul_mat(graph_ctx, weight, inputs)
            if mul is not None and mul != 1:
                out = g.ggml_scale(graph_ctx, out, float(mul))
            if cap is not None:
                inverse = float(np.float32(1) / np.float32(cap))  # 1.0f / f_final_logit_softcapping
                out = g.ggml_scale(graph_ctx, g.ggml_tanh(graph_ctx, g.ggml_scale(graph_ctx, out, inverse)), float(cap))
            graph = g.ggml_new_graph(graph_ctx)
            g.ggml_build_forward_expand(graph, out)
            placed = self.buffer_type(product, weight, (number, K, N))
            for ctx, buffer_type in ((weights_ctx, placed), (graph_ctx, self.buffer_types[-1])):
                buffers.append(g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buffer_type))
                if not buffers[-1]:
                    raise MemoryError(f"ggml could not allocate a buffer for a product [{T}, {K}] x [{N}, {K}]")
            if g.ggml_nbytes(weight) != stored.nbytes:
                raise RuntimeError(f"ggml holds a {W.format} [{N}, {K}] in {g.ggml_nbytes(weight)} bytes, the "
                                   f"blocks are {stored.nbytes}: the installed ggml is not the layout bound here")
            g.ggml_backend_tensor_set(weight, stored.ctypes.data, 0, stored.nbytes)
            g.ggml_backend_tensor_set(inputs, x.ctypes.data, 0, x.nbytes)
            status = g.ggml_backend_graph_compute(self.backend, graph)
            if status != 0:
                raise RuntimeError(f"ggml_backend_graph_compute returned {status}:\n{self.lib.log_tail()}")
            result = np.empty((T, N), np.float32)
            g.ggml_backend_tensor_get(out, result.ctypes.data, 0, result.nbytes)
            return result
        finally:
            for buffer in buffers:
                if buffer:
                    g.ggml_backend_buffer_free(buffer)
            for ctx in (graph_ctx, weights_ctx):
                if ctx:
                    g.ggml_free(ctx)

    def close(self):
        if self.backend:
            self.g.ggml_backend_free(self.backend)
            self.backend = None


class LlamaCpp:
    """The llama.cpp backend (module docstring); options as strings, as ``--backend`` passes them."""

    dtypes = DTYPES
    # What llama.cpp promises of its logits' bits: nothing.  Its server's documentation (tools/server/README.md,
    # `cache_prompt`) says they are not guaranteed bit for bit identical for different batch sizes (prompt
    # processing against token generation), so neither batch nor chunk; its maintainers answer that different
    # batch sizes take different matrix product kernels (ggml-org/llama.cpp#4479, #3014), and it has no
    # deterministic mode (#16016, CUDA only, not merged), so not run either.  Measured: docs/invariance.md.
    invariance = frozenset()

    def __init__(self, kv: str = DEFAULTS["kv"], fa: str = DEFAULTS["fa"], threads: str | None = None,
                 cache_dir: str | None = None, source: str | None = None, weights: str | None = None):
        if weights is not None and weights not in OP_WEIGHTS:
            raise ValueError(f"weights={weights!r}: llama.cpp's op tests take W in one of GGUF's block formats "
                             f"{', '.join(OP_WEIGHTS)}, whose products ggml computes")
        if kv not in KV_TYPES:
            raise ValueError(f"kv={kv!r}: the KV cache type must be one of {', '.join(KV_TYPES)}")
        if fa not in FLASH_ATTENTION:
            raise ValueError(f"fa={fa!r}: flash attention must be one of {', '.join(FLASH_ATTENTION)}")
        if threads is not None and not (str(threads).isdigit() and int(threads) > 0):
            raise ValueError(f"threads={threads!r}: must be a positive integer")
        self.kv, self.fa = kv, fa
        self.threads = int(threads) if threads else (os.cpu_count() or 1)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.name = f"llama.cpp-kv_{kv}-fa_{fa}"
        self.version = library_version()
        self.source = find_source(source, self.cache_dir)
        self.conversions: dict[tuple[str, str], Conversion] = {}  # (checkpoint, dtype) -> its GGUF
        self._models: dict[Path, Model] = {}
        self.flash_attention: bool | None = None  # what fa resolved to in the last forward
        # What the adapter rounds beyond the dtype under test.  With ``weights``: that weight format and the
        # activation format llama.cpp rounds x to for it (op_formats), for the op tests and every forward.
        # Without: what the GGUF of the last forward or session rounds (Model.formats), a quantized GGUF's
        # activation format, so that its products are judged with its derived term.
        self.weights = weights
        self.formats: dict[str, str] = op_formats(weights) if weights else {}
        self._products: Products | None = None

    @property
    def notes(self) -> str:
        """The settings as llama.cpp ran them, for reports."""
        fa = {"auto": "auto (llama.cpp's default)", "on": "on", "off": "off"}[self.fa]
        if self.flash_attention is not None:
            fa += f", ran {'with' if self.flash_attention else 'without'} flash_attn_ext"
        converted = ", ".join(f"{GGUF_TYPES[d]} {c.seconds:.0f} s" for (_, d), c in self.conversions.items()
                              if c.seconds is not None)
        exported = ", ".join(str(path) for path in self._models if path.name == GGUF_NAME)
        return (f"llama-cpp-python {self.version}; KV cache {self.kv}"
                f"{' (llama.cpp default)' if self.kv == DEFAULTS['kv'] else ''}; flash attention {fa}; "
                + (f"op tests: {self.weights} weights through ggml_mul_mat on the CPU backend; "
                   if self.weights else "")
                + (f"activations rounded to {self.formats['activations']} blocks before each product with a "
                   f"quantized weight (declared)" if self.formats else
                   "activations float32, GGUF F32/BF16/F16 from convert_hf_to_gguf")
                + (f"; converted: {converted}" if converted else "")
                + (f"; ran the exported GGUF {exported} as it is" if exported else ""))

    def gguf(self, checkpoint, dtype: str) -> Path:
        """The GGUF of ``checkpoint`` for ``dtype`` (converted once, cached)."""
        if checkpoint is None:
            raise ValueError("llama.cpp runs a GGUF converted from the checkpoint folder, and these weights came "
                             "from no folder (run on a checkpoint folder: the generated one or --weights)")
        if dtype not in DTYPES:
            raise ValueError(f"{self.name} runs {', '.join(DTYPES)}, not {dtype}")
        exported = Path(checkpoint) / GGUF_NAME
        if exported.is_file():  # a folder exported from a GGUF (quantize below): the GGUF runs as it is
            return exported
        key = (str(Path(checkpoint).resolve()), dtype)
        if key not in self.conversions:
            self.conversions[key] = convert(Path(key[0]), dtype, self.cache_dir, self.source)
        return self.conversions[key].gguf

    def _model(self, checkpoint, dtype: str) -> Model:
        path = self.gguf(checkpoint, dtype)
        if path not in self._models:
            self._models[path] = Model(Library.get(), path)
        model = self._models[path]
        if self.weights is None:
            self.formats = model.formats
        elif model.block_types and (model.formats != {"activations": self.formats["activations"]}
                                    or WEIGHT_FORMATS[self.weights].ggml_type not in model.block_types):
            raise ValueError(f"{self.name} declares weights={self.weights} (activations "
                             f"{self.formats['activations']}), and {path} holds {', '.join(sorted(model.block_types))} "
                             f"blocks: its products would round beyond the declaration (run the forward on a GGUF "
                             f"holding {WEIGHT_FORMATS[self.weights].ggml_type}, or without the option)")
        return model

    # ---- op level: the products of quantized weights (Products) --------------------------------------

    def linear(self, W, x):
        """``x W^T`` (spec.linear) with W a QuantizedWeight, through ggml_mul_mat on the CPU backend."""
        return self._product("linear", [W], x)[0]

    def gate_up(self, Wg, Wu, x):
        """spec.gate_up: ``Wg x`` and ``Wu x`` (two products, as llama.cpp's ffn_gate and ffn_up), joined gate first."""
        return np.concatenate(self._product("gate_up", [Wg, Wu], x), axis=-1)

    def lm_head(self, mul, cap, W, x):
        """spec.lm_head as llama.cpp's Gemma graph builds the logits: the product, ggml_scale by mul (its
        graph has none, mul 1), and with a cap ggml_scale(1 / cap), ggml_tanh, ggml_scale(cap), in float32."""
        if cap is not None and cap == 0:
            raise Unsupported("llama.cpp's graph reads a softcap of 0 as no cap (it builds the cap only where "
                              "f_final_logit_softcapping is not 0), where the spec's cap 0 gives 0")
        return self._product("lm_head", [W], x, mul=mul, cap=cap)[0]

    def _product(self, op: str, weights: list, x, **head) -> list[np.ndarray]:
        """Each of ``weights`` times x (``[..., K]``): x in the dtype under test converted to float32 (exactly),
        llama.cpp's float32 result rounded to that dtype once.  Arguments the op tests may hand that llama.cpp's
        products do not take are refused (``Unsupported``, a skip with the reason)."""
        x = np.asarray(x)
        dtype = str(x.dtype)
        if dtype not in DTYPES:
            raise Unsupported(f"llama.cpp's {op} runs x in {', '.join(DTYPES)} (its activations are float32), "
                              f"not {dtype}")
        for W in weights:
            fmt = getattr(W, "format", None)
            if not isinstance(W, QuantizedWeight) or fmt not in OP_WEIGHTS:
                got = f"a {fmt} QuantizedWeight" if isinstance(W, QuantizedWeight) else f"W as {type(W).__name__}"
                raise Unsupported(f"llama.cpp's {op} takes W as a QuantizedWeight in a GGUF block format its "
                                  f"products compute ({', '.join(OP_WEIGHTS)}), as --backend='llama.cpp[weights=...]' "
                                  f"declares; got {got}")
            if self.weights is not None and fmt != self.weights:
                raise Unsupported(f"{self.name} declares weights={self.weights}, and {op} was handed {fmt} blocks, "
                                  f"whose products round x to a format it did not declare")
        if self._products is None:
            self._products = Products(Library.get(), self.threads)
        rows = x.astype(np.float32).reshape(-1, x.shape[-1])
        with np.errstate(over="ignore"):  # past the dtype's range the rounding is inf, as the spec's is
            return [self._products(W, rows, **head).astype(x.dtype).reshape(*x.shape[:-1], W.shape[0])
                    for W in weights]

    def forward(self, weights, config, tokens, dtype: str, checkpoint=None) -> dict:
        """Every position's logits, the layers' outputs and the trace of one llama.cpp decode of ``tokens``."""
        cfg = config if isinstance(config, TextConfig) else TextConfig.from_dict(config)
        model = self._model(checkpoint, dtype)
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        collector = TraceCollector(cfg)
        # One ubatch for the whole prompt, so the trace is one graph's.
        with Context(model, self, _cells(T), 1, _cells(T), collector) as ctx:
            logits = ctx.decode(tokens, np.arange(T), np.zeros(T, np.int64))
        self.flash_attention = collector.flash_attention
        trace = collector.trace()
        hidden = [trace.get(f"layers.{layer.index}.layer_scalar") for layer in cfg.layers]
        hidden = [h.reshape(T, cfg.hidden_size) for h in hidden] if all(h is not None for h in hidden) else None
        return {"logits": logits, "hidden_states": hidden, "trace": trace}

    def session(self, weights, config, dtype: str, checkpoint=None, capacity: int = 4096,
                sequences: int = 16) -> "Session":
        """A serving session (issue 12's contract) on llama.cpp's multi-sequence KV cache: ``capacity``
        cells shared by up to ``sequences`` live sequences."""
        cfg = config if isinstance(config, TextConfig) else TextConfig.from_dict(config)
        return Session(self, self._model(checkpoint, dtype), cfg, dtype, capacity, sequences)

    def close(self):
        for model in self._models.values():
            model.close()
        self._models.clear()
        if self._products is not None:
            self._products.close()
            self._products = None


class Session:
    """Sequences of the suite (any int ids) on llama.cpp's sequence slots of one context (module docstring)."""

    UBATCH = 512

    def __init__(self, adapter: LlamaCpp, model: Model, config: TextConfig, dtype: str, capacity: int, sequences: int):
        self.dtype = format_of(dtype).dtype  # the serving contract's logits are in the dtype: llama.cpp's float32, rounded once
        self.config = config
        self.context = Context(model, adapter, _cells(capacity), sequences, min(self.UBATCH, _cells(capacity)),
                               traceable=True)
        self.live: dict[int, list[int]] = {}  # suite id -> [slot, next position]
        self.free = list(range(sequences))
        self.capacity = _cells(capacity)

    def step(self, chunks: dict) -> dict:
        """``{seq: tokens}`` appended now (one batch, mixed prefill and decode) -> ``{seq: logits [n, V]}``."""
        tokens, positions, slots, rows = self._batch(chunks)
        logits = [self.context.decode(tokens[i:i + self.capacity], positions[i:i + self.capacity],
                                      slots[i:i + self.capacity]) for i in range(0, len(tokens), self.capacity)]
        logits = np.concatenate(logits) if logits else np.zeros((0, self.context.model.vocab), np.float32)
        return {seq: logits[r].astype(self.dtype) for seq, r in rows.items()}

    def traced_step(self, chunks: dict) -> tuple[dict, dict]:
        """``step``, and per sequence the trace of its rows: node -> ``[n, ...]`` (llama.cpp's float32
        activations, whatever the dtype).  The batch is decoded one ubatch at a time, as llama.cpp splits
        a batch in order when its cache is unified, so that each trace is one graph's."""
        tokens, positions, slots, rows = self._batch(chunks)
        logits, traces, n_ubatch = [], [], self.context.n_ubatch
        for i in range(0, len(tokens), n_ubatch):
            part = slice(i, i + n_ubatch)
            self.context.collector = TraceCollector(self.config)
            try:
                logits.append(self.context.decode(tokens[part], positions[part], slots[part]))
                trace = self.context.collector.trace()
            finally:
                self.context.collector = None
            # [n, ...] whatever n: a single token's [1, H, D] comes back [H, D] (GraphTensor.shape)
            traces.append({node: v.reshape(len(logits[-1]), -1) for node, v in trace.items()})
        logits = np.concatenate(logits) if logits else np.zeros((0, self.context.model.vocab), np.float32)
        joined = {node: np.concatenate([t[node] for t in traces]) for node in traces[0]} if traces else {}
        return ({seq: logits[r].astype(self.dtype) for seq, r in rows.items()},
                {seq: {node: v[r] for node, v in joined.items()} for seq, r in rows.items()})

    def _batch(self, chunks: dict):
        """The batch of one step: its tokens, positions and slots, and each sequence's rows in it."""
        tokens, positions, slots, rows = [], [], [], {}
        for seq, new in chunks.items():
            new = np.asarray(new, dtype=np.int64).reshape(-1)
            if seq not in self.live:
                if not self.free:
                    raise RuntimeError(f"llama.cpp session: sequence {seq} starts while all {len(self.live)} slots "
                                       f"are live (release one, or open the session with more sequences)")
                self.live[seq] = [self.free.pop(0), 0]
            slot, start = self.live[seq]
            rows[seq] = slice(len(tokens), len(tokens) + len(new))
            tokens.extend(new.tolist())
            positions.extend(range(start, start + len(new)))
            slots.extend([slot] * len(new))
            self.live[seq][1] = start + len(new)
        return tokens, positions, slots, rows

    def release(self, seq) -> None:
        slot, _ = self.live.pop(seq)
        self.context.remove(slot)
        self.free.append(slot)

    def close(self) -> None:
        self.context.close()


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gemma4_conformance.adapters.llama_cpp_backend",
                                     description="Set up the llama.cpp backend.",
                                     epilog="quantize CHECKPOINT FOLDER --type {" + ",".join(QUANTIZED) + "}: a GGUF "
                                            "of CHECKPOINT quantized by llama.cpp, exported to FOLDER for --weights")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch-converter", help="keep llama.cpp's converter of the installed "
                                                        "llama-cpp-python in the cache folder (pip downloads its sdist)")
    fetch.add_argument("--cache-dir", type=Path, default=None)
    pre = commands.add_parser("convert", help="convert a checkpoint folder to GGUF now, into the cache")
    pre.add_argument("checkpoint", type=Path)
    pre.add_argument("--dtype", action="append", choices=DTYPES, help="repeatable; default: all three")
    pre.add_argument("--cache-dir", type=Path, default=None)
    pre.add_argument("--source", default=None)
    quant = commands.add_parser("quantize", help="a GGUF of a checkpoint folder quantized by llama.cpp, exported "
                                                 "with its exact weights to a checkpoint folder (for --weights)")
    quant.add_argument("checkpoint", type=Path)
    quant.add_argument("folder", type=Path)
    quant.add_argument("--type", required=True, choices=list(QUANTIZED))
    quant.add_argument("--cache-dir", type=Path, default=None)
    quant.add_argument("--source", default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch-converter":
            print(fetch_converter(args.cache_dir))
            return
        cache_dir = args.cache_dir or default_cache_dir()
        source = find_source(args.source, cache_dir)
        if args.command == "quantize":
            print(quantize(args.checkpoint.resolve(), args.type, args.folder, cache_dir, source))
            return
        for dtype in args.dtype or DTYPES:
            done = convert(args.checkpoint.resolve(), dtype, cache_dir, source)
            print(f"{dtype}: {done.gguf}" + (f" ({done.seconds:.0f} s)" if done.seconds is not None else " (cached)"))
    except (SetupError, GGUFExportError) as e:
        sys.exit(str(e))


if __name__ == "__main__":
    main()
