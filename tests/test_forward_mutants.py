"""A forward with one model-level mistake fails the full-forward verdict.

Each mutant is an adapter with its own ``forward`` (the contract's optional method): the spec's graph
run with the numpy ops, but with one mistake an engine could make in wiring the model.  The verdict
compares it with the float64 reference and the plain same-dtype baseline, as the suite does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from adapters import numpy_backend
from fixtures import checkpoint, generate
from fixtures.config import TextConfig
from properties.forward import AdapterOps, composed, judge_forward, reference
from spec.model import forward

TOKENS = 24


class Rewired(AdapterOps):
    """The numpy ops with some op calls redirected, to wire a mistake into the graph."""

    def __init__(self, dtype, rename=None, values_after_rope=False):
        super().__init__(numpy_backend, dtype)
        self.rename = rename or {}
        self.values_after_rope = values_after_rope
        self.last_rope = None

    def op(self, name, *args):
        if name == "rope":
            self.last_rope = out = super().op(name, *args)
            return out
        if self.values_after_rope and name == "rmsnorm_unit" and self.last_rope is not None \
                and self.last_rope.shape == args[1].shape and args[1].shape[1] == 1:
            args = (args[0], self.last_rope)  # v from the normed, rotated keys on the full layers
        return super().op(self.rename.get(name, name), *args)


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


MUTANTS = [
    ForwardMutant("layer_scalar_ignored", edit_weights=_scalars_ignored),
    ForwardMutant("values_after_k_norm_and_rope", values_after_rope=True),
    ForwardMutant("final_softcap_missing", edit_config=_no_softcap),
    ForwardMutant("full_rope_denominator_rot_times_partial_factor", edit_config=_proportional_denominator),
    ForwardMutant("norms_as_one_plus_w", rename={"rmsnorm": "rmsnorm_offset"}),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    weights = checkpoint.load(generate.write_checkpoint(tmp_path_factory.mktemp("small"), generate.small_config()))
    tokens = np.random.default_rng(0).integers(0, weights.config.vocab_size, TOKENS)
    ref, _ = reference(weights.config, weights, tokens, certify=False)
    return weights, tokens, ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_model_level_mistake_fails_the_forward_verdict(model, mutant, dtype):
    weights, tokens, ref = model
    candidate = composed(mutant, weights.config, weights, tokens, dtype)
    baseline = composed(numpy_backend, weights.config, weights, tokens, dtype)
    verdict = judge_forward(candidate, baseline, ref, dtype)
    assert verdict.failures, (f"{mutant.name} passed in {dtype}: logits error {verdict.logits[0]:.3g} "
                              f"vs baseline {verdict.logits[1]:.3g}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_correct_wiring_passes(model, dtype):
    """The same machinery with no mistake passes, so the failures above come from the mistakes."""
    weights, tokens, ref = model
    candidate = composed(ForwardMutant("none"), weights.config, weights, tokens, dtype)
    baseline = composed(numpy_backend, weights.config, weights, tokens, dtype)
    assert not judge_forward(candidate, baseline, ref, dtype).failures
