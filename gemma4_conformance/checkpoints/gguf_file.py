"""A real GGUF file's text weights as a checkpoint folder the suite reads exactly (issue 36, item 5).

An engine that runs a GGUF (llama.cpp) runs the numbers its blocks hold, not the checkpoint it was made
from: to judge it, the reference forward must run on those numbers.  ``export`` copies every weight of
the graph out of the GGUF into a checkpoint folder in the suite's layout (``checkpoint.load``): a
quantized tensor keeps its blocks byte for byte (``U8`` ``[rows, row bytes]`` and the
``weight_formats`` metadata, ``docs/quantized.md``), which the loader dequantizes exactly
(``quantized.py``); a float tensor keeps its type (F32, F16, BF16).  The GGUF's layout is read with
llama.cpp's own reader (the ``gguf`` package), its tensor names mapped to the checkpoint's by the
package's own name map, so no layout is written twice.  The GGUF file is copied into the folder
(``GGUF_NAME``), so the engine and the reference read one file's weights.

A block type the suite cannot dequantize exactly (``quantized.WEIGHT_FORMATS``: q8_0, q4_0, q4_k,
q6_k) is an error naming the tensor and the type: a GGUF whose quantizer fell back to another type
(llama.cpp's q4_K_M writes q5_0 where a row is not a multiple of 256) cannot be judged exactly yet.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .checkpoint import FORMATS_KEY, SINGLE_NAME, TEXT_PREFIX, canonical_names, expected_shapes, stored_name
from .config import TextConfig
from .quantized import WEIGHT_FORMATS

GGUF_TYPES = {f.ggml_type: f for f in WEIGHT_FORMATS.values() if f.ggml_type}  # GGUF's name -> format

GGUF_NAME = "model.gguf"  # the GGUF an exported folder was made from, copied beside its safetensors
FLOAT_TYPES = {"F32": ("F32", np.float32), "F16": ("F16", np.float16), "BF16": ("BF16", np.uint16)}


class GGUFExportError(ValueError):
    """The GGUF cannot be exported exactly: the message names the tensor and why."""


def tensors(gguf_path: Path, cfg: TextConfig) -> dict[str, tuple[str, str | None, np.ndarray]]:
    """Canonical name -> (safetensors dtype, weight format or None, stored array) for every weight of the
    graph, read from ``gguf_path`` (its arrays as the file holds them: blocks as uint8 ``[rows, row bytes]``)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    by_name = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_layers)
    shapes = expected_shapes(cfg)
    out = {}
    for canonical in canonical_names(cfg):
        name = names.get_name(canonical, try_suffixes=(".weight", ".bias"))
        # The converter names every tensor of a module "<name>.weight", a layer scalar included
        t = by_name.get(name) or by_name.get(f"{name}.weight")
        if t is None:
            raise GGUFExportError(f"{gguf_path}: no tensor {name} (the checkpoint's {canonical})")
        kind = t.tensor_type.name
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml's ne, reversed: numpy's order
        while len(shape) > len(shapes[canonical]) and shape[0] == 1:
            shape = shape[1:]
        if shape != shapes[canonical]:
            raise GGUFExportError(f"{gguf_path}: {name} is {list(shape)}, the checkpoint's {canonical} is "
                                  f"{list(shapes[canonical])}")
        if kind in FLOAT_TYPES:
            code, dtype = FLOAT_TYPES[kind]
            out[canonical] = (code, None, np.asarray(t.data).view(dtype).reshape(shape))
        elif kind in GGUF_TYPES:
            fmt = GGUF_TYPES[kind]
            out[canonical] = ("U8", fmt.name, np.asarray(t.data, dtype=np.uint8).reshape(fmt.stored_shape(shape)))
        else:
            raise GGUFExportError(f"{gguf_path}: {name} is stored as {kind}, which the suite cannot dequantize "
                                  f"exactly (it reads {', '.join(GGUF_TYPES)} and "
                                  f"{', '.join(FLOAT_TYPES)})")
    return out


def export(gguf_path, checkpoint, folder) -> Path:
    """Write the checkpoint folder ``folder`` holding ``gguf_path``'s weights of the graph that the checkpoint
    folder ``checkpoint`` (the one the GGUF was converted from) describes: its config.json, and the GGUF
    itself (``GGUF_NAME``)."""
    gguf_path, folder = Path(gguf_path), Path(folder)
    config_file = Path(checkpoint) / "config.json"
    cfg = TextConfig.from_file(config_file)
    found = tensors(gguf_path, cfg)
    folder.mkdir(parents=True, exist_ok=True)
    header, formats, offset = {}, {}, 0
    for canonical, (code, fmt, array) in found.items():
        stored = stored_name(canonical, TEXT_PREFIX)
        header[stored] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        if fmt is not None:
            formats[stored] = fmt
    header["__metadata__"] = {"format": "pt", "source": gguf_path.name, **({FORMATS_KEY: json.dumps(formats)}
                                                                          if formats else {})}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(folder / SINGLE_NAME, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, _, array in found.values():
            f.write(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes())
    shutil.copyfile(config_file, folder / "config.json")
    shutil.copyfile(gguf_path, folder / GGUF_NAME)
    return folder
