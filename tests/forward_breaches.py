"""Adapters whose forward breaks the forward contract in one way each (properties/forward.py).

Each computes the right model (the spec's graph with the numpy ops) and returns it in a shape, count
or form the contract refuses, as a hand-written engine wrapper might.  Load one with
--backend=tests.forward_breaches:ADAPTERS.<name>.
"""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.checkpoints.config import TextConfig
from gemma4_conformance.composition.graph import AdapterOps, TraceRecorder
from gemma4_conformance.spec.model import forward


class Breach:
    """The right forward, returned through ``edit(out, config)``; ``None`` as edit returns it as it is."""

    dtypes = ("float32", "bfloat16", "float16")

    def __init__(self, name, edit=None):
        self.name, self.edit = name, edit

    def forward(self, weights, config, tokens, dtype, checkpoint=None):
        cfg = TextConfig.from_dict(config)
        recorder = TraceRecorder()
        out = forward(AdapterOps(numpy_backend, dtype, observe=recorder), cfg, weights, tokens)
        out["trace"] = recorder.trace
        return out if self.edit is None else self.edit(out, cfg)


def _with(out, **changes):
    return {**out, **changes}


def _nan_at_position_3(out, cfg):
    logits = out["logits"].copy()
    logits[3, 7] = np.nan
    return _with(out, logits=logits)


def _raises(out, cfg):
    raise RuntimeError("engine crashed: out of KV blocks")


BREACHES = [
    # (adapter, the words its message must contain)
    (Breach("last_position_only", lambda out, cfg: _with(out, logits=out["logits"][-1])),
     "only one position's logits"),
    (Breach("batch_axis", lambda out, cfg: _with(out, logits=out["logits"][None])), "a batch axis"),
    (Breach("padded_vocabulary", lambda out, cfg: _with(out, logits=np.pad(out["logits"], ((0, 0), (0, 128))))),
     "a vocabulary padded to 640"),
    (Breach("logits_in_a_narrower_dtype",  # in a float32 run
            lambda out, cfg: _with(out, logits=out["logits"].astype(ml_dtypes.bfloat16))),
     "returned logits in bfloat16, narrower than the dtype under test"),
    (Breach("embedding_counted_as_a_hidden_state",
            lambda out, cfg: _with(out, hidden_states=[out["trace"]["embed"], *out["hidden_states"]])),
     "hidden states (the embedding output counted first"),
    (Breach("hidden_states_with_a_batch_axis",
            lambda out, cfg: _with(out, hidden_states=[h[None] for h in out["hidden_states"]])),
     "hidden_states[0] has shape (1, 24, 64); expected the layer's output [T, H] = [24, 64]"),
    (Breach("trace_node_that_does_not_exist",
            lambda out, cfg: _with(out, trace={**out["trace"], "layers.0.qkv_proj": out["trace"]["layers.0.q_proj"]})),
     "trace node 'layers.0.qkv_proj' does not exist"),
    (Breach("trace_node_of_the_wrong_size",
            lambda out, cfg: _with(out, trace={**out["trace"],
                                               "layers.0.k_proj": out["trace"]["layers.0.k_proj"][:, :8]})),
     "trace node 'layers.0.k_proj' has 192 values"),
    (Breach("nan_where_the_reference_is_finite", _nan_at_position_3), "NaN in logits at (3, 7)"),
    (Breach("raises", _raises), "raised RuntimeError: engine crashed"),
]

# A correct forward that gives logits only: its summary and report say the hidden states were not provided.
LOGITS_ONLY = Breach("logits_only", lambda out, cfg: {"logits": out["logits"]})

ADAPTERS = SimpleNamespace(**{adapter.name: adapter for adapter, _ in BREACHES}, logits_only=LOGITS_ONLY)
