"""Engines that round beyond the dtype under test, as quantized engines do: the numpy reference with its
products (linear, gate_up, lm_head) computed on x rounded to ``q8_0`` blocks, as llama.cpp's CPU path
rounds its activations.  ``DECLARED`` says so in its ``formats``; ``UNDECLARED`` is the same engine
without the declaration, which the suite must fail.  Load one with
--backend=tests.quantized_engines:DECLARED (or :UNDECLARED).

Also the mistakes an engine's dequantization can make, as edits of a block's bytes that the right
dequantization then reads wrongly (tests/test_quantized.py, and the forward mutants that read a
quantized checkpoint's blocks themselves: tests/forward_mutants.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from gemma4_conformance.adapters.numpy_backend import RoundsActivations
from gemma4_conformance.checkpoints.quantized import WEIGHT_FORMATS

# byte offsets of each format's fp16 scales in a block (d, and dmin in q4_k)
SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}


DECLARED = RoundsActivations("q8_0", "numpy-q8_0-activations", {"activations": "q8_0"})
UNDECLARED = RoundsActivations("q8_0", "numpy-q8_0-activations-undeclared")


def set_scale(blocks: np.ndarray, at: int, bits: np.ndarray) -> None:
    blocks[:, at:at + 2] = np.asarray(bits, dtype="<u2").reshape(-1, 1).view(np.uint8).reshape(-1, 2)


def min_with_wrong_sign(name: str, blocks: np.ndarray) -> np.ndarray:
    """``q4_k`` blocks with dmin's sign flipped: dequantized, each sub-block's min is added, not subtracted."""
    assert name == "q4_k", "only q4_k's blocks have a min"
    out = blocks.copy()
    out[:, 3] ^= 0x80
    return out


def scales_in_bfloat16(name: str, blocks: np.ndarray) -> np.ndarray:
    """Blocks with every fp16 scale rounded to bfloat16 (8 significant bits) and back, as a dequantization
    that reads the scales into bfloat16 does."""
    out = blocks.copy()
    for at in SCALES[name]:
        scale = out[:, at:at + 2].copy().view("<f2").astype(np.float32)
        with np.errstate(over="ignore"):  # a scale near 65504 rounds to bfloat16's 65536: inf
            set_scale(out, at, scale.astype(ml_dtypes.bfloat16).astype(np.float32).astype("<f2").view("<u2"))
    return out


def dequantized_wrongly(mistake, weights):
    """The checkpoint's tensors, each quantized matrix read from its blocks with ``mistake``; a checkpoint
    without quantized matrices is refused (the mutant would be the reference)."""
    formats = weights.weight_formats
    if not formats:
        raise ValueError("this engine reads a quantized checkpoint's blocks: give --weights a quantized one")
    out = {name: weights[name] for name in weights}
    for name, format_name in formats.items():
        info, fmt = weights.info(name), WEIGHT_FORMATS[format_name]
        blocks = np.fromfile(info.file, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        with np.errstate(over="ignore", invalid="ignore"):
            out[name] = fmt.dequantize(mistake(format_name, blocks.reshape(-1, fmt.block_bytes)).reshape(
                fmt.stored_shape(info.shape)))
    return out
