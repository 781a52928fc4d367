"""A recorded run judged from its trace file (tracefile.py, docs/trace-file.md): the per-node verdicts and
the forward verdict that the in-process tests give (properties/test_forward.py), on what the file holds.

``load`` checks the file against the graph and the checkpoint.  Each thing wrong with it is a
*breach*, one message naming the file and the node (or the metadata key): a tensor the reader could
not read (truncated, a forged entry), a name that is no node of the graph, a size that fits no
reshape of the node, a dtype narrower than the one the metadata declares, NaN, missing positions,
metadata that disagrees with the checkpoint.  A breached node is left out, so it is judged "not
traced" (its message says why) and every other node is still judged; the tests then raise the
breaches together (a broken file: exit 6).  A file that cannot be judged at all (unreadable, no token
ids, an unknown format or dtype, positions other than a prompt's 0..T-1) raises ContractViolation.

A subset is judged for what it holds.  Nodes left out are "not traced", and a node whose inputs were
left out "inputs not traced" (trace.py); the chain resumes at the next node whose inputs are all
there.  The forward verdict needs ``logits``, and judges each layer's own error only when every
``layers.{i}.layer_scalar`` (the layer outputs, hidden_states[i]) is there; otherwise the logits
alone.  Fewer positions are a shorter prompt: the model is causal, so the first T' positions of a
run are the run on its first T' tokens, and a file cut to them is judged as that prompt.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gemma4_conformance import tracefile
from gemma4_conformance.adapters import DTYPES, declared_formats, formats_problem
from gemma4_conformance.adapters.contract import ContractViolation, wide_enough
from gemma4_conformance.spec import format_of
from gemma4_conformance.spec.model import nodes

from .trace import NODE_WORK, TraceVerdict, completed, judge_trace, replay


@dataclass
class Recorded:
    """A trace file checked against the graph: its nodes that can be judged, and its breaches."""

    path: Path
    engine: str
    dtype: str
    tokens: np.ndarray
    trace: dict[str, np.ndarray]
    breaches: dict[str, str]  # node, tensor or "metadata ..." -> the message (naming the file)
    formats: dict[str, str]  # the engine's declared formats (docs/quantized.md), as its metadata gives them

    def forward_breaches(self, config) -> list[str]:
        """The breaches that bear on the forward verdict: its logits, layer outputs and metadata."""
        outputs = {"logits", *(f"layers.{layer.index}.layer_scalar" for layer in config.layers)}
        return [m for key, m in self.breaches.items() if key in outputs or key.startswith("metadata")
                or key == tracefile.POSITIONS]

    def candidate(self, config) -> dict | None:
        """The forward test's candidate (logits [T, V]; hidden_states when every layer output is there),
        None when the file holds no usable logits."""
        if "logits" not in self.trace:
            return None
        T, H = len(self.tokens), config.hidden_size
        layers = [self.trace.get(f"layers.{layer.index}.layer_scalar") for layer in config.layers]
        hidden = None if any(h is None for h in layers) else [h.reshape(T, H) for h in layers]
        return {"logits": self.trace["logits"].reshape(T, config.vocab_size), "hidden_states": hidden}


def load(path, weights) -> Recorded:
    """The trace file at ``path`` checked against ``weights`` (a checkpoints.checkpoint.Checkpoint) and its
    config (module docstring)."""
    where = str(path)
    try:
        found = tracefile.read(path)
    except tracefile.TraceFileError as e:
        raise ContractViolation(str(e)) from None
    meta, config = found.metadata, weights.config
    if (meta.get("format"), meta.get("format_version")) != (tracefile.FORMAT, tracefile.VERSION):
        raise ContractViolation(f"{where}: metadata format {meta.get('format')!r} version "
                                f"{meta.get('format_version')!r}; this suite reads {tracefile.FORMAT!r} version "
                                f"{tracefile.VERSION!r} (docs/trace-file.md)")
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        raise ContractViolation(f"{where}: metadata dtype {dtype!r} is not one of {', '.join(DTYPES)}: the dtype "
                                f"under test, whose budgets judge every node")
    breaches = {f"metadata {key}": f"{where}: metadata {key!r} is missing (docs/trace-file.md)"
                for key in tracefile.METADATA if key not in meta}
    if not any(key in meta for key in tracefile.CHECKPOINT_KEYS):
        breaches["metadata checkpoint"] = (f"{where}: metadata names no checkpoint: give checkpoint (a path) or "
                                           f"checkpoint_sha256")
    digest = meta.get("checkpoint_sha256")
    if digest is not None and digest != checkpoint_sha256(weights):
        breaches["metadata checkpoint_sha256"] = (
            f"{where}: metadata checkpoint_sha256 {digest[:16]}... disagrees with the checkpoint judged against, "
            f"{weights.path} ({checkpoint_sha256(weights)[:16]}...): the trace was recorded on other weights")
    breaches |= {name: f"{where}: tensor {name!r}: {why}" for name, why in found.problems.items()}
    tokens = _tokens(found, where, config.vocab_size)
    positions = found.tensors.get(tracefile.POSITIONS)
    if positions is None:
        breaches.setdefault(tracefile.POSITIONS, f"{where}: tensor 'positions' is missing (I64 [T], 0..T-1)")
    elif positions.shape != tokens.shape or not np.array_equal(positions, np.arange(len(tokens))):
        raise ContractViolation(f"{where}: positions {positions.ravel()[:8].tolist()}... are not the prompt's "
                                f"0..{len(tokens) - 1}: only a whole prompt's run from position 0 is judged")
    graph, sizes = nodes(config), _sizes(config, weights, tokens, dtype)
    trace = {}
    for name, value in found.tensors.items():
        if name in (tracefile.TOKENS, tracefile.POSITIONS):
            continue
        why = ""
        if name not in graph:
            why = ("is not a node of the graph (spec.model.nodes: embed, layers.{i}.<name>, final_norm, logits) "
                   "nor tokens or positions")
        elif not wide_enough(value, dtype):
            why = f"is {value.dtype}, narrower than the declared dtype {dtype}; a node is {dtype} or wider"
        elif value.size != sizes[name]:
            why = (f"has {value.size} values (shape {list(value.shape)}); the node has {sizes[name]} "
                   f"for {len(tokens)} tokens, in any row-major reshape of its graph shape")
        elif np.isnan(value).any():
            at = [int(i) for i in np.argwhere(np.isnan(value))[0]]
            why = f"is NaN at {at} ({int(np.isnan(value).sum())} NaN in all)"
        if why:
            breaches[name] = f"{where}: node {name!r} {why}"
        else:
            trace[name] = value
    return Recorded(Path(path), meta.get("engine", "?"), dtype, tokens, trace, breaches, _formats(meta, where))


def _formats(meta: dict[str, str], where: str) -> dict[str, str]:
    """The declared formats the metadata gives: judged with them, as the engine's run in process would be; a
    value the suite does not know breaks the file (judged without it, the verdict would be the wrong one)."""
    try:
        formats = tracefile.formats_of(meta)
    except ValueError as e:
        raise ContractViolation(f"{where}: {e}") from None
    problem = formats_problem(formats, "gives")
    if problem:
        raise ContractViolation(f"{where}: metadata {tracefile.FORMATS!r} {problem}")
    return formats


def _tokens(found, where: str, vocab: int) -> np.ndarray:
    tokens = found.tensors.get(tracefile.TOKENS)
    if tokens is None:
        why = found.problems.get(tracefile.TOKENS, "missing")
        raise ContractViolation(f"{where}: tensor 'tokens' (the prompt's token ids, I64 [T]) is {why}: "
                                f"nothing can be judged without them")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or not len(tokens) or not (
            (tokens >= 0) & (tokens < vocab)).all():
        raise ContractViolation(f"{where}: tensor 'tokens' is {tokens.dtype} {list(tokens.shape)}; expected "
                                f"I64 or I32 [T], T > 0, each id below the vocabulary's {vocab}")
    return np.asarray(tokens, dtype=np.int64)


class _Shapes:
    """The checkpoint's tensors as zeros of their shapes in the dtype under test (broadcast: no memory):
    replaying an empty trace on them gives every node's size without reading a weight."""

    def __init__(self, weights, dtype: str):
        self.weights, self.zero = weights, np.zeros((), format_of(dtype).dtype)

    def __getitem__(self, name):
        return np.broadcast_to(self.zero, self.weights.info(name).shape)


def _sizes(config, weights, tokens, dtype) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for call in replay({}, config, _Shapes(weights, dtype), tokens, dtype):
        sizes[call.node] = sizes.get(call.node, 0) + call.out.size  # the LM head's chunks add up
    return sizes


def judge_nodes(recorded: Recorded, weights, work: int = NODE_WORK) -> TraceVerdict:
    """Every node of the file judged as the trace test judges it (trace.judge_trace); a breached node's
    message says why it was left out."""
    verdict = judge_trace(recorded.trace, weights.config, weights, recorded.tokens, recorded.dtype, work,
                          where=str(recorded.path), formats=recorded.formats)
    for n in verdict.nodes:
        if n.node in recorded.breaches:
            n.message = f"not judged: {recorded.breaches[n.node]}"
    return verdict


def checkpoint_sha256(weights) -> str:
    """``checkpoint_sha256`` of the checkpoint (tracefile.checkpoint_digest), once per set of files."""
    return _digest(tuple(str(f) for f in weights.files))


@functools.cache
def _digest(files: tuple[str, ...]) -> str:
    return tracefile.checkpoint_digest(files)


def record(folder, adapter, dtype: str, weights, tokens, out: dict) -> Path:
    """Write a forward's output (``composed``'s, checked) as a trace file in ``folder``: its trace with
    the logits and layer outputs standing for their nodes (trace.completed); returns the file."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{adapter.name}-{dtype}")
    return tracefile.write(Path(folder) / f"{name}.safetensors", tokens=tokens,
                           nodes=completed(out["trace"], out, weights.config), engine=adapter.name, dtype=dtype,
                           engine_version=str(getattr(adapter, "version", "")),
                           device=str(getattr(adapter, "device", "cpu")), checkpoint=str(weights.path),
                           checkpoint_sha256=checkpoint_sha256(weights), formats=declared_formats(adapter))
