"""Engines that round beyond the dtype under test, as quantized engines do: the numpy reference with its
products (linear, gate_up, lm_head) computed on x rounded to ``q8_0`` blocks, as llama.cpp's CPU path
rounds its activations.  ``DECLARED`` says so in its ``formats``; ``UNDECLARED`` is the same engine
without the declaration, which the suite must fail.  Load one with
--backend=tests.quantized_engines:DECLARED (or :UNDECLARED).
"""

from __future__ import annotations

import numpy as np

from gemma4_conformance.adapters import numpy_backend as reference
from gemma4_conformance.checkpoints.quantized import WEIGHT_FORMATS

Q8_0 = WEIGHT_FORMATS["q8_0"]


def rounded_to_q8_0(x: np.ndarray) -> np.ndarray:
    """x's values rounded to q8_0 blocks along the last axis (a last, partial block padded with zeros),
    exactly, by llama.cpp's reference quantizer: float32, or float64 for a float64 x (each value, an fp16
    scale times an int8, is exact in float32)."""
    x = np.asarray(x)
    K = x.shape[-1]
    rows = np.zeros((int(np.prod(x.shape[:-1], dtype=np.int64)), -(-K // Q8_0.block) * Q8_0.block), dtype=np.float32)
    rows[:, :K] = x.reshape(-1, K)
    values = Q8_0.dequantize(Q8_0.quantize(rows))[:, :K].reshape(x.shape)
    return values.astype(np.float64 if x.dtype == np.float64 else np.float32)


def _on_rounded_activations(op: str):
    base = getattr(reference, op)

    def run(*args):
        *head, x = args
        return base(*head, rounded_to_q8_0(x))  # the result in the weights' dtype, the dtype under test

    run.__name__ = op
    return run


class RoundsActivations:
    """The numpy reference, its products on q8_0-rounded activations; ``formats`` as given."""

    def __init__(self, name: str, formats: dict[str, str] | None):
        self.name, self.dtypes = name, reference.dtypes
        if formats is not None:
            self.formats = formats
        for op in ("linear", "gate_up", "lm_head"):
            setattr(self, op, _on_rounded_activations(op))

    def __getattr__(self, attribute):
        return getattr(reference, attribute)


DECLARED = RoundsActivations("numpy-q8_0-activations", {"activations": "q8_0"})
UNDECLARED = RoundsActivations("numpy-q8_0-activations-undeclared", None)
