"""Deliberately wrong model wiring: adapters whose ``forward`` runs the spec's graph with one mistake.

Each is the graph run with the numpy ops in the dtype, but with one mistake an engine could make in
wiring the model (a config, weights or op-call edit).  Load one with
--backend=tests.forward_mutants:ADAPTERS.<name>.  The ``QUANTIZED`` ones read a quantized checkpoint's
blocks themselves and dequantize them with one mistake: each runs with --weights of a checkpoint in
its format.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from types import SimpleNamespace

import numpy as np

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.checkpoints.config import TextConfig
from gemma4_conformance.composition.graph import AdapterOps
from gemma4_conformance.spec.model import forward
from tests.quantized_engines import (dequantized_wrongly, fp8_scales_in_bfloat16, int4_zero_point_ignored,
                                    min_with_wrong_sign, scales_in_bfloat16)


class Rewired(AdapterOps):
    """The numpy ops with some op calls redirected, to wire a mistake into the graph."""

    def __init__(self, dtype, rename=None, values_after_rope=False):
        super().__init__(numpy_backend, dtype)
        self.rename = rename or {}
        self.values_after_rope = values_after_rope
        self.last_rope = None

    def op(self, node, name, *args):
        if name == "rope":
            self.last_rope = out = super().op(node, name, *args)
            return out
        if self.values_after_rope and name == "rmsnorm_unit" and self.last_rope is not None \
                and self.last_rope.shape == args[1].shape and args[1].shape[1] == 1:
            args = (args[0], self.last_rope)  # v from the normed, rotated keys on the full layers
        return super().op(node, self.rename.get(name, name), *args)


class ForwardMutant:
    """An adapter whose forward is the graph with one mistake (``config``/``weights``/``ops`` edits)."""

    dtypes = ("float32", "bfloat16")

    def __init__(self, name, edit_config=None, edit_weights=None, **ops):
        self.name, self.edit_config, self.edit_weights, self.ops = name, edit_config, edit_weights, ops

    def forward(self, weights, config, tokens, dtype):
        cfg = TextConfig.from_dict(config)
        if self.edit_config:
            cfg = self.edit_config(cfg)
        if self.edit_weights:
            weights = self.edit_weights(weights)
        return forward(Rewired(dtype, **self.ops), cfg, weights, tokens)


def _no_softcap(cfg):
    return dataclasses.replace(cfg, final_softcap=None)


def _proportional_denominator(cfg):
    """The full layers' frequencies over rot * partial_rotary_factor (128 of 512) instead of the head dim."""
    layers = tuple(dataclasses.replace(l, rope_denom=l.rope_rot // 4) if l.kind == "full" else l for l in cfg.layers)
    return dataclasses.replace(cfg, layers=layers)


def _scalars_ignored(weights):
    return {name: (np.ones_like(weights[name]) if name.endswith("layer_scalar") else weights[name]) for name in weights}


def _full_layers_windowed(cfg):
    """The layer pattern lost: full layers attend through the sliding window like the others."""
    window = next(l.window for l in cfg.layers if l.kind == "sliding")
    layers = tuple(dataclasses.replace(l, kind="sliding", window=window) for l in cfg.layers)
    return dataclasses.replace(cfg, layers=layers)


MUTANTS = [
    ForwardMutant("layer_scalar_ignored", edit_weights=_scalars_ignored),
    ForwardMutant("full_layers_windowed", edit_config=_full_layers_windowed),
    ForwardMutant("values_after_k_norm_and_rope", values_after_rope=True),
    ForwardMutant("final_softcap_missing", edit_config=_no_softcap),
    ForwardMutant("full_rope_denominator_rot_times_partial_factor", edit_config=_proportional_denominator),
    ForwardMutant("norms_as_one_plus_w", rename={"rmsnorm": "rmsnorm_offset"}),
]

# (mutant, the weight format of the checkpoint it reads)
QUANTIZED = [
    (ForwardMutant("q4_k_min_with_wrong_sign", edit_weights=partial(dequantized_wrongly, min_with_wrong_sign)), "q4_k"),
    (ForwardMutant("q4_k_scales_rounded_to_bfloat16", edit_weights=partial(dequantized_wrongly, scales_in_bfloat16)),
     "q4_k"),
    (ForwardMutant("fp8_scales_rounded_to_bfloat16", edit_weights=partial(dequantized_wrongly, fp8_scales_in_bfloat16)),
     "fp8_e4m3_channel"),
    (ForwardMutant("int4_zero_point_ignored", edit_weights=partial(dequantized_wrongly, int4_zero_point_ignored)),
     "int4_g32"),  # 32-value groups fit every matrix of the small geometry
]

ADAPTERS = SimpleNamespace(**{mutant.name: mutant for mutant in MUTANTS + [m for m, _ in QUANTIZED]})
