"""The spec's graph run with an adapter's ops: ``AdapterOps`` (the graph's ops object, every call under
the contract's checks) and ``composed``, the forward of an adapter (its own, checked, or its ops
composed by the graph), with the trace of every node when asked.
"""

from __future__ import annotations

import numpy as np

from gemma4_conformance.adapters.contract import call, check_output, run_forward
from gemma4_conformance.spec import format_of
from gemma4_conformance.spec.model import OPS_USED, forward


def missing_ops(adapter) -> list[str]:
    """The graph's ops ``adapter`` does not implement: with any, its ops cannot be composed."""
    return [op for op in OPS_USED if not hasattr(adapter, op)]


class AdapterOps:
    """An adapter's ops in one dtype, under the contract's checks: the graph's ops object for backends."""

    def __init__(self, adapter, dtype: str, observe=None):
        self.adapter, self.dtype, self.observe = adapter, dtype, observe
        self.name = adapter.name

    def op(self, node, name, *args):
        return self.observed(node, name, args, self.call(name, *args))

    def call(self, name, *args):
        """The adapter's op under the contract's checks, unobserved (a node computed in parts calls it per part)."""
        return call(self.adapter, name, args, self.dtype)

    def observed(self, node, name, args, out):
        if self.observe is not None:
            self.observe(node, name, args, out)
        return out

    def weight(self, array):
        return np.asarray(array).astype(format_of(self.dtype).dtype, copy=False)  # the ops get copies (contract.call)


class TraceRecorder:
    """An ops object's observer that keeps every node's output: the trace of a composed forward.  The
    LM head's calls (one per VOCAB_CHUNK columns, all under the node ``logits``) are joined along the
    vocabulary, as an engine's trace of that node would be."""

    def __init__(self):
        self.trace: dict[str, np.ndarray] = {}

    def __call__(self, node, op, args, out):
        if node in self.trace:
            out = np.concatenate([self.trace[node], out], axis=-1)
        self.trace[node] = out


def composed(adapter, config, weights, tokens, dtype: str, trace: bool = False) -> dict:
    """``logits``, ``hidden_states`` (None when not given) and ``trace`` (None when not given): the
    adapter's own forward under the contract's checks if it has one, else the spec's graph run with its
    ops in ``dtype`` (which records the trace when ``trace``)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if hasattr(adapter, "forward"):
        return check_output(run_forward(adapter, config, weights, tokens, dtype), config, len(tokens), dtype,
                            f"{adapter.name}.forward in {dtype}")
    recorder = TraceRecorder() if trace else None
    out = forward(AdapterOps(adapter, dtype, observe=recorder), config, weights, tokens)
    return {**out, "trace": recorder.trace if trace else None}
