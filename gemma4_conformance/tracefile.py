"""The trace file: one engine run (token ids, positions, logits, and the engine's own values at the nodes
of the spec's graph) in one safetensors file, recorded anywhere and judged by the suite elsewhere.

The format is described for engine authors in docs/trace-file.md: tensors named by the nodes of
``spec.model.nodes(config)`` (``embed``, ``layers.{i}.q_proj``, ..., ``final_norm``, ``logits``) plus
``tokens`` and ``positions``, each in the dtype the engine holds it (bf16 bit for bit), and a
``__metadata__`` of strings (``METADATA``).  ``write`` is the Python writer; ``read`` takes a file
without trusting it: a file that cannot be read at all is a ``TraceFileError``, and a tensor whose
entry or bytes are wrong is listed in ``TraceFile.problems`` while every other tensor is still read,
so one broken node never hides the others.  What the tensors must be against the graph (names, sizes,
dtypes, NaN, the checkpoint) is checked where they are judged (properties/recorded.py).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import serialize_file
from safetensors.numpy import TensorSpec

from gemma4_conformance.checkpoints.checkpoint import safetensors_header

FORMAT = "gemma4-conformance-trace"
VERSION = "1"
TOKENS, POSITIONS = "tokens", "positions"
# Required metadata; a file also gives ``checkpoint`` (a path) or ``checkpoint_sha256`` (checkpoint_digest), or both.
METADATA = ("format", "format_version", "engine", "engine_version", "dtype", "device")
CHECKPOINT_KEYS = ("checkpoint", "checkpoint_sha256")
# Optional: the engine's declared formats (docs/quantized.md), "key=value,..." as a backend's bracket options.
FORMATS = "formats"

# safetensors dtype code -> numpy dtype, for the dtypes a trace may hold (little-endian, as the format is)
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "BF16": np.dtype(ml_dtypes.bfloat16),
          "F16": np.dtype("<f2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4")}


class TraceFileError(ValueError):
    """A trace file that cannot be read at all; the message names the file and what is wrong."""


@dataclass
class TraceFile:
    """What ``read`` found: the metadata, the tensors it could read (read-only views of the file), and
    per tensor it could not, why."""

    path: Path
    metadata: dict[str, str]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)


def read(path) -> TraceFile:
    """The trace file at ``path`` (module docstring); raises TraceFileError when nothing can be read."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header, n = safetensors_header(f, size, path, TraceFileError)
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise TraceFileError(f"{path}: cannot read: {e.strerror or e}") from None
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TraceFileError(f"{path}: no __metadata__ of strings in the header; a trace file needs "
                             f"{', '.join(METADATA)} and {' or '.join(CHECKPOINT_KEYS)} (docs/trace-file.md)")
    trace = TraceFile(path, metadata)
    start, length = 8 + n, size - 8 - n
    for name, entry in header.items():
        why = _entry_problem(entry, length)
        if why:
            trace.problems[name] = why
            continue
        dtype, count = DTYPES[entry["dtype"]], math.prod(entry["shape"])
        begin = entry["data_offsets"][0]
        trace.tensors[name] = np.frombuffer(data, dtype, count, start + begin).reshape(entry["shape"])
    return trace


def _entry_problem(entry, data_length: int) -> str:
    """Why a header entry cannot be read as a tensor, or "" when it can."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        return f"corrupt header entry {str(entry)[:200]}: expected dtype, shape and data_offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        return f"dtype {str(dtype)[:20]!r} is not one a trace holds ({', '.join(DTYPES)})"
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        return f"corrupt shape {str(shape)[:100]}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return f"corrupt data_offsets {str(offsets)[:100]}"
    need = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != need:
        return f"{dtype} {shape} needs {need} bytes but its data_offsets span {offsets[1] - offsets[0]}"
    if offsets[1] > data_length:
        return f"truncated: its data ends at byte {offsets[1]} of a data section of {data_length} bytes"
    return ""


def write(path, *, tokens, nodes: dict, engine: str, dtype: str, engine_version: str = "", device: str = "cpu",
          checkpoint: str | None = None, checkpoint_sha256: str | None = None,
          formats: dict[str, str] | None = None) -> Path:
    """Write one run's trace file: ``tokens`` (the prompt, positions 0..T-1), ``nodes`` (graph node ->
    array in the engine's own dtype, ``logits`` among them) and the metadata, with the engine's declared
    ``formats`` where it has any; returns the path."""
    if checkpoint is None and checkpoint_sha256 is None:
        raise ValueError("a trace file names its checkpoint: give checkpoint (a path) or checkpoint_sha256")
    tokens = np.asarray(tokens, dtype=np.int64)
    arrays = {TOKENS: tokens, POSITIONS: np.arange(len(tokens), dtype=np.int64),
              **{node: np.ascontiguousarray(value) for node, value in nodes.items()}}
    metadata = {"format": FORMAT, "format_version": VERSION, "engine": engine, "engine_version": engine_version,
                "dtype": dtype, "device": device}
    metadata |= {k: v for k, v in zip(CHECKPOINT_KEYS, (checkpoint, checkpoint_sha256)) if v is not None}
    if formats:
        metadata[FORMATS] = ",".join(f"{key}={value}" for key, value in formats.items())
    codes = {dt: code for code, dt in DTYPES.items()}
    specs = {}
    for name, a in arrays.items():
        if a.dtype not in codes:
            raise ValueError(f"trace node {name!r}: dtype {a.dtype} is not one a trace holds ({', '.join(DTYPES)})")
        specs[name] = TensorSpec(dtype=a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    serialize_file(specs, str(path), metadata=metadata)  # `arrays` holds the buffers alive meanwhile
    return path


def formats_of(metadata: dict[str, str]) -> dict[str, str]:
    """The declared formats a file's metadata gives ({} where none); a ValueError names an item that is not
    key=value."""
    formats = {}
    for item in filter(None, (part.strip() for part in metadata.get(FORMATS, "").split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip() or not value.strip():
            raise ValueError(f"metadata {FORMATS!r} item {item!r} is not key=value")
        formats[key.strip()] = value.strip()
    return formats


def checkpoint_digest(files) -> str:
    """``checkpoint_sha256``: the SHA-256 of the checkpoint's safetensors files' bytes, the files taken
    in the order of their names (so sharding the same bytes differently changes it; a path does not)."""
    digest = hashlib.sha256()
    for file in sorted(Path(f) for f in files):
        with open(file, "rb") as f:
            while chunk := f.read(2**24):
                digest.update(chunk)
    return digest.hexdigest()
