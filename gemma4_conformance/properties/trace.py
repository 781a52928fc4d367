"""Per-node verdicts from an engine's trace: where, op by op, a forward departs from the spec.

``judge_trace`` replays the trace through the spec's graph (``Replay`` as its ops object), so each
traced node's op gets the engine's own inputs, and judges each node against that op's budget in the
dtype under test.  How, and what "not traced" and "inputs not traced" mean: docs/verdict.md (the trace).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.spec import CONTRACT, format_of
from gemma4_conformance.spec.model import forward, nodes

from .judging import BeyondDeclared, assess
from .table import OPS, block_format

NODE_WORK = 1_000  # oracle work per judged node, in element operations (table.py): about one row

PASSED, FAILED, NOT_TRACED, INPUTS_NOT_TRACED = "passed", "failed", "not traced", "inputs not traced"
OUTCOMES = (PASSED, FAILED, NOT_TRACED, INPUTS_NOT_TRACED)


class Untraced(np.ndarray):
    """The stand-in for a node the trace omits (zeros of its shape); views and reshapes keep the mark."""

    node: str | None = None

    def __array_finalize__(self, obj):
        self.node = getattr(obj, "node", None)


def _stand_in(shape, dtype, node: str) -> Untraced:
    out = np.zeros(shape, dtype).view(Untraced)
    out.node = node
    return out


@dataclass
class Call:
    """One op call of the replayed graph: its node, op, arguments (the engine's values) and output."""

    node: str
    op: str
    args: tuple
    out: np.ndarray
    traced: bool
    untraced_inputs: tuple[str, ...]


class Replay:
    """The ops object of the replay: each node's value is the engine's traced array (module docstring)."""

    name = "trace replay"

    def __init__(self, trace: dict, dtype: str, vocab: int, where: str, exact_weights: bool = False):
        self.trace, self.dtype, self.vocab, self.where = trace, dtype, vocab, where
        self.exact_weights = exact_weights
        self.calls: list[Call] = []
        self.columns: dict[str, int] = {}  # node -> columns of its trace used so far (the LM head's chunks)

    def weight(self, array):
        """A weight as the node is judged on it: as the op contract hands it, in the dtype under test, but for
        an engine that holds its weights in a block format (``exact_weights``), a quantized tensor's exact
        values (float64 from the checkpoint, the only float64 tensors it gives; as float32 where that holds
        them), which are what that engine multiplies, as the op tests judge it (judging.held)."""
        array = np.asarray(array)
        if self.exact_weights and array.dtype == np.float64:
            narrow = array.astype(np.float32)
            return narrow if np.array_equal(narrow, array) else array
        # copy=False: a weight stored in the dtype under test stays a view of the checkpoint's memory map,
        # read only where a judged node uses it (a one-layer trace of the 12B model reads one layer).
        return array.astype(format_of(self.dtype).dtype, copy=False)

    def op(self, node, name, *args):
        shape = CONTRACT[name].output_shape(*args)
        untraced = tuple(sorted({a.node for a in args if isinstance(a, Untraced)}))
        if node in self.trace:
            out = self._traced(node, shape)
        else:
            out = _stand_in(shape, format_of(self.dtype).dtype, node)
        # Only a call that will be judged keeps its arguments: the others' weights are not held for the replay.
        kept = args if node in self.trace and not untraced else ()
        self.calls.append(Call(node, name, kept, out, node in self.trace, untraced))
        return out

    def _traced(self, node, shape) -> np.ndarray:
        value = self.trace[node]
        if node != "logits":
            if value.size != int(np.prod(shape)):
                raise ContractViolation(f"{self.where}: trace node {node!r} has {value.size} values "
                                        f"(shape {tuple(value.shape)}); expected {int(np.prod(shape))}, the graph's "
                                        f"{list(shape)} or any reshape of it in row-major order")
            return np.asarray(value).reshape(shape)
        # The LM head is called once per vocabulary chunk: its trace is [T, V], sliced by columns.
        rows, n = shape[:-1], shape[-1]
        total = int(np.prod(rows)) * self.vocab
        if value.size != total:
            raise ContractViolation(f"{self.where}: trace node 'logits' has {value.size} values (shape "
                                    f"{tuple(value.shape)}); expected {total}, [T, V] = {[*rows, self.vocab]}")
        start = self.columns.get(node, 0)
        self.columns[node] = start + n
        return np.asarray(value).reshape(*rows, self.vocab)[..., start:start + n]


@dataclass
class NodeVerdict:
    """One node's outcome: passed or failed against its op's budget, or not judged (and why)."""

    node: str
    op: str
    outcome: str  # one of OUTCOMES
    error: float | None = None  # largest error, ULPs of the dtype at the op's scale (judged nodes)
    budget: float | None = None  # the op's budget for this node's dimensions, same unit
    message: str = ""  # why it failed, or which inputs were not traced
    informative: bool = True  # its budget excludes trivially wrong answers (zeros, the sign flipped, ...)
    formats: dict[str, str] = field(default_factory=dict)  # the declared formats whose terms its budget held

    @property
    def given(self) -> str:
        """"given its declared formats: activations q8_0" where its budget held declared terms; else ""."""
        listed = ", ".join(f"{key} {name}" for key, name in sorted(self.formats.items()))
        return f"given its declared formats: {listed}" if listed else ""

    @property
    def layer(self) -> int | None:
        return int(self.node.split(".")[1]) if self.node.startswith("layers.") else None

    @property
    def where(self) -> str:
        """The node's row in the table by layer: ``embed``, ``layer 7`` or ``final``."""
        if self.layer is not None:
            return f"layer {self.layer}"
        return "embed" if self.node == "embed" else "final"


@dataclass
class TraceVerdict:
    """Every node of the graph for one engine and dtype, in graph order."""

    dtype: str
    nodes: list[NodeVerdict]
    work: int = NODE_WORK
    rerun: str = ""  # the command that reruns the forward and this verdict (set by the test)
    failures: list[str] = field(default_factory=list)

    @property
    def first_departure(self) -> NodeVerdict | None:
        return next((n for n in self.nodes if n.outcome == FAILED), None)

    def counts(self) -> dict[str, int]:
        return {o: sum(n.outcome == o for n in self.nodes) for o in OUTCOMES}

    def by_layer(self) -> list[dict]:
        """Rows ``embed``, ``layer 0`` ... ``final``: nodes, judged, passed, failed, not traced, inputs not traced."""
        rows: dict[str, dict] = {}
        for n in self.nodes:
            row = rows.setdefault(n.where, {"where": n.where, "nodes": 0, "judged": 0,
                                            **{o: 0 for o in OUTCOMES}, "failed_nodes": []})
            row["nodes"] += 1
            row[n.outcome] += 1
            row["judged"] += n.outcome in (PASSED, FAILED)
            if n.outcome == FAILED:
                row["failed_nodes"].append(n.node.rsplit(".", 1)[-1])
        return list(rows.values())

    def summary(self) -> str:
        """One line: the first departing node, or that none of the judged nodes departs."""
        c = self.counts()
        judged = c[PASSED] + c[FAILED]
        first = self.first_departure
        given = sorted({f"{key} {name}" for n in self.nodes for key, name in n.formats.items()})
        given = f" given its declared formats: {', '.join(given)}" if given else ""
        head = (f"first departing node {first.node} ({first.op}, {self.dtype}): {first.error:.3g} ULPs > budget "
                f"{first.budget:.3g}{' ' + first.given if first.given else ''}" if first and first.error is not None
                else f"first departing node {first.node} ({first.op}, {self.dtype})" if first
                else f"no node departs ({judged} judged){given}")
        rest = f"{c[FAILED]} of {judged} judged nodes failed" if first else ""
        weak = sum(n.outcome == PASSED and not n.informative for n in self.nodes)
        weak = f"{weak} passed where their budget admits a trivially wrong answer (zeros, ...)" if weak else ""
        unjudged = c[NOT_TRACED] + c[INPUTS_NOT_TRACED]
        tail = f"{unjudged} not judged ({c[NOT_TRACED]} not traced, {c[INPUTS_NOT_TRACED]} with inputs not traced)" \
            if unjudged else ""
        return "; ".join(part for part in (head, rest, weak, tail) if part)


def replay(trace: dict, config, weights, tokens, dtype: str, where: str = "trace",
           exact_weights: bool = False) -> list[Call]:
    """Every op call of the graph with the trace's values (module docstring, step 1), a quantized tensor's
    exact values where ``exact_weights`` (``Replay.weight``); a size that does not fit its node raises
    ContractViolation."""
    graph = nodes(config)
    unknown = sorted(set(trace) - set(graph))
    if unknown:
        raise ContractViolation(f"{where}: trace node(s) {unknown} do not exist in the graph (spec.model.nodes)")
    ops = Replay(trace, dtype, config.vocab_size, where, exact_weights)
    forward(ops, config, weights, np.asarray(tokens, dtype=np.int64))
    return ops.calls


def completed(trace: dict | None, out: dict, config) -> dict:
    """The trace with the forward's own outputs standing for the nodes they are: ``logits`` and, per
    layer, ``hidden_states[i]`` for ``layers.{i}.layer_scalar``, where the trace omits them."""
    full = dict(trace or {})
    full.setdefault("logits", out["logits"])
    for i, h in enumerate(out.get("hidden_states") or []):
        full.setdefault(f"layers.{config.layers[i].index}.layer_scalar", h)
    return full


def judge_trace(trace: dict, config, weights, tokens, dtype: str, work: int = NODE_WORK,
                where: str = "trace", formats: dict[str, str] | None = None) -> TraceVerdict:
    """Replay ``trace`` through the graph and judge every node on the engine's own inputs (module docstring),
    within the allowance the engine's declared ``formats`` add to its op's budget (judging.assess), as the
    op tests judge it."""
    calls = replay(trace, config, weights, tokens, dtype, where, exact_weights=block_format(formats or {}) is not None)
    verdicts: dict[str, NodeVerdict] = {}
    for index, c in enumerate(calls):
        if not c.traced:
            v = NodeVerdict(c.node, c.op, NOT_TRACED, message="the engine's trace omits it")
        elif c.untraced_inputs:
            v = NodeVerdict(c.node, c.op, INPUTS_NOT_TRACED,
                            message=f"its input(s) {', '.join(c.untraced_inputs)} were not traced")
        else:
            v = _judge(c, dtype, index, work, formats)
        if c.node in verdicts:  # the LM head's chunks: one node, the worst chunk
            v = _worse(verdicts[c.node], v)
        verdicts[c.node] = v
    verdict = TraceVerdict(dtype, list(verdicts.values()), work)
    first = verdict.first_departure
    if first is not None:
        verdict.failures.append(f"trace: {verdict.summary()}: {first.message}")
    return verdict


def _judge(c: Call, dtype: str, seed: int, work: int, formats: dict[str, str] | None) -> NodeVerdict:
    """The node's op on a sample of the call's outputs; an attention node also on its last query, which
    sees the most keys and, past the window, the window's edge (a drawn query may be an early one).
    Inputs a declared format cannot hold (judging.BeyondDeclared) fail the node: there the engine's
    rounding has no bound it declared."""
    samples = [(c.args, c.out)]
    if OPS[c.op].prefill:
        *head, pos, q, k, v = c.args
        last = int(np.argmax(pos))
        samples.append(((*head, pos[last:last + 1], q[last:last + 1], k, v), c.out[last:last + 1]))
    verdict = None
    for args, out in samples:
        try:
            judged = assess(c.op, args, out, dtype, seed=seed, work=work, formats=formats)
        except BeyondDeclared as e:
            return NodeVerdict(c.node, c.op, FAILED, message=f"{c.node}: {e}")
        error, budget = judged.worst  # the tier with the least headroom (attention has two)
        node = NodeVerdict(c.node, c.op, FAILED if judged.failures else PASSED, error, budget,
                           "; ".join(judged.failures), judged.informative, judged.formats)
        verdict = node if verdict is None else _worse(verdict, node)
    return verdict


_RANK = {PASSED: 0, INPUTS_NOT_TRACED: 1, NOT_TRACED: 2, FAILED: 3}


def _worse(a: NodeVerdict, b: NodeVerdict) -> NodeVerdict:
    if _RANK[a.outcome] != _RANK[b.outcome]:
        return a if _RANK[a.outcome] > _RANK[b.outcome] else b
    if a.error is None or b.error is None:
        return a
    return a if a.error / a.budget >= b.error / b.budget else b
