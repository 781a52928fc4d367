"""Invariance: the same logits whatever the run, the batch or the chunking (issue 28).

Accuracy asks how far an engine's logits are from the exact ones; invariance asks whether they change
when nothing a user controls changes.  Three relations on a session (the serving contract of
serving.py), each compared bitwise, never against the reference:

* run: a schedule played twice, each time in a fresh session, gives the same logits;
* batch: each sequence's logits alone (the same chunks and decode steps, in a session of its own)
  equal its logits beside the schedule's partners, which join and leave while it runs: every
  sequence, since a kernel may change for the one that joins and not for the one it joins;
* chunk: a prompt prefilled in one call, in the drawn chunks and token by token gives the same logits
  at every position (its decode steps included), each way alone in its session.

The schedules are the serving test's (drawn and shrunk by Hypothesis); a sequence reads the tokens
of its document.  An adapter declares what it promises (``invariance``, adapters/__init__.py): a
promise that breaks fails the run; an unpromised relation is measured and reported only.

Op by op, ``OpInvariance`` finds which kernel breaks batch invariance: each op of a forward's graph,
at its first nodes, computed on all its rows twice (a call that does not repeat is run variance,
reported as such) and on each row alone (``linear``, ``gate_up`` and
``lm_head`` also in blocks of several M rows: split-K and tile choices follow the batch size);
attention on a query with the queries after it and the keys they see beside it, against the query
alone with its own keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gemma4_conformance.adapters import INVARIANCE
from gemma4_conformance.composition.graph import AdapterOps
from gemma4_conformance.spec import CONTRACT
from gemma4_conformance.spec.formats import scale_ulp, ulp_distance
from gemma4_conformance.spec.model import forward, nodes

from .serving import Documents, case_json, play
from .table import OPS

RELATIONS = INVARIANCE
DESCRIPTIONS = {"run": "the same schedule played twice, in fresh sessions",
                "batch": "each sequence alone against beside its partners",
                "chunk": "a prompt prefilled in one call, in chunks and token by token"}


def fixed(window: int) -> dict:
    """The schedule every run checks first, smaller than the serving test's (each relation plays it
    several times): a prompt past the window in two chunks, then decode steps; a partner's prompt joins
    its first decode step (a step of 4 rows where it alone has 1, as in continuous batching) and the
    partner leaves before it ends."""
    return {"sequences": [{"id": 0, "join": 0, "chunks": [window - 3, 5], "decode": 3},
                          {"id": 1, "join": 2, "chunks": [3], "decode": 1}]}


def claims(adapter) -> frozenset[str]:
    """What ``adapter`` promises (checked when it was loaded)."""
    return frozenset(getattr(adapter, "invariance", ()))


@dataclass
class Difference:
    """Where two plays of one sequence differ: the first differing position, how many rows differ, and the
    largest difference in two units: ``scaled``, in ULPs of the dtype at the row's scale (its largest
    magnitude), the scale the accuracy verdicts use; ``ulps``, value by value (how many values of the
    format lie between the two: near zero, where the format is dense, a small difference is many)."""

    sequence: int
    position: int
    rows: int
    scaled: float
    ulps: float
    against: str  # what was compared, e.g. "token by token against one call"
    schedule: dict | None = None
    node: str = ""  # the first node of the graph where the two plays differ ("" when not located)
    node_rows: int = 0  # the rows of the sequence that differ there

    def describe(self) -> str:
        return f"{self.scaled:.3g} ULPs at the row's scale ({self.ulps:.3g} value by value)"

    def first(self) -> str:
        return f"{self.node}, {self.node_rows} row{'s' if self.node_rows != 1 else ''}" if self.node else ""


def at_row_scale(a: np.ndarray, b: np.ndarray, dtype: str) -> float:
    """The largest difference of a row of ``a`` from ``b``'s, in ULPs of ``dtype`` at the row's scale: its
    largest magnitude in ``b`` (inf where a value is not finite in one and is in the other)."""
    a, b = (np.asarray(x, np.float64).reshape(len(x), -1) for x in (a, b))
    with np.errstate(invalid="ignore"):
        gap = np.where(np.isfinite(a) & np.isfinite(b), np.abs(a - b), np.where(np.isnan(a) & np.isnan(b), 0, np.inf))
    scale = np.max(np.abs(np.where(np.isfinite(b), b, 0)), axis=1)
    return float(np.max(np.max(gap, axis=1) / scale_ulp(scale, dtype)))


def compare(a: np.ndarray, b: np.ndarray, dtype: str, sequence: int, against: str) -> Difference | None:
    """Bitwise, row by row: None when every row is identical."""
    def bits(x):
        return np.ascontiguousarray(x).view(np.uint8).reshape(len(x), -1)

    differ = np.any(bits(a) != bits(b), axis=1) if a.dtype == b.dtype else np.ones(len(a), bool)
    if not differ.any():
        return None
    ulps = float(ulp_distance(a[differ], b[differ], dtype).max())
    return Difference(sequence, int(np.argmax(differ)), int(differ.sum()), at_row_scale(a[differ], b[differ], dtype),
                      ulps, against)


@dataclass
class Verdict:
    """One schedule under one relation: the rows compared, and each sequence's difference."""

    rows: int
    differences: list[Difference]

    def first(self, graph) -> Difference | None:
        """The located difference whose node comes first in ``graph`` (the nodes in order), if any."""
        order = {node: i for i, node in enumerate(graph)}
        return min((d for d in self.differences if d.node), key=lambda d: order[d.node], default=None)

    def message(self, relation: str, dtype: str, graph=()) -> str:
        first = self.first(graph)
        where = f"; it breaks first at {first.first()} (sequence {first.sequence})" if first else ""
        lines = [f"{relation} invariance ({DESCRIPTIONS[relation]}) does not hold in {dtype}{where}:"]
        lines += [f"  sequence {d.sequence}, {d.against}: from position {d.position}, {d.rows} rows differ, by up "
                  f"to {d.describe()}" + (f"; first at {d.first()}" if d.node else "") for d in self.differences]
        return "\n".join(lines)


def _alone(sequence: dict, chunks: list[int]) -> dict:
    return {"sequences": [{"id": 0, "join": 0, "chunks": chunks, "decode": sequence["decode"]}]}


class Plays:
    """Plays shared by the relations, per adapter, dtype, schedule and tokens: the run relation's first play
    of a schedule is the batch relation's play beside the partners, and the batch relation's first
    sequence alone is the chunk relation's play in the drawn chunks.  The run
    relation's second play is always a fresh one.  A play asked ``traced`` the first time it is made is
    traced from the start where the session's traced steps are its plain ones (``serving.play``'s
    ``plain_only``): a difference in it is then located without replaying it."""

    def __init__(self):
        self.plays: dict[tuple, tuple[list[np.ndarray], list[dict] | None]] = {}

    def __call__(self, adapter, schedule: dict, tokens: list[np.ndarray], documents: Documents, dtype: str,
                 traced: bool = False) -> tuple[list[np.ndarray], list[dict] | None]:
        """Per sequence its rows, and its trace (None when the play is not traced)."""
        key = (adapter.name, dtype, case_json(schedule), b"".join(t.tobytes() for t in tokens))
        if key not in self.plays:
            rows, _, _, traces = play(adapter, schedule, tokens, documents, dtype, trace=traced, plain_only=True)
            self.plays[key] = rows, traces
        return self.plays[key]


def check(relation: str, adapter, schedule: dict, documents: Documents, dtype: str, plays: Plays,
          locate: bool = False, traced: bool = False) -> Verdict:
    """Play what ``relation`` compares for ``schedule`` (through ``plays``) and compare it bitwise; with
    ``locate``, find where each difference begins (``first_node``), and with ``traced`` too, play traced from
    the start where that gives the plain rows, so that locating replays nothing (for the schedule most
    likely to differ: a difference found costs no more plays, none found costs the traces' memory)."""
    sequences = schedule["sequences"]
    tokens = [documents.of(k, s) for k, s in enumerate(sequences)]
    traced = traced and locate

    def shared(schedule, tokens):
        return plays(adapter, schedule, tokens, documents, dtype, traced)

    # Per pair: the sequence, its rows in two plays, what was compared, and each play as a side
    # (schedule, tokens, index, its traces or None).
    if relation == "run":
        again, _, _, again_traces = play(adapter, schedule, tokens, documents, dtype, trace=traced, plain_only=True)
        first, first_traces = shared(schedule, tokens)
        pairs = [(k, again[k], rows, "the second play against the first",
                  ((schedule, tokens, k, again_traces), (schedule, tokens, k, first_traces)))
                 for k, rows in enumerate(first)]
    elif relation == "batch":  # every sequence, each alone in a play of its own
        together, together_traces = shared(schedule, tokens)
        pairs = []
        for k, s in enumerate(sequences):
            alone = _alone(s, s["chunks"])
            rows, traces = shared(alone, tokens[k:k + 1])
            pairs.append((k, together[k], rows[0], "beside its partners against alone",
                          ((schedule, tokens, k, together_traces), (alone, tokens[k:k + 1], 0, traces))))
    else:  # chunk: the first sequence, alone, its prompt in one call, in its drawn chunks, token by token
        s = sequences[0]
        prompt = sum(s["chunks"])
        whole = _alone(s, [prompt])
        ways = {"token by token": _alone(s, [1] * prompt)}
        if s["chunks"] != [prompt]:
            ways[f"in chunks {s['chunks']}"] = _alone(s, s["chunks"])
        one_call, one_call_traces = shared(whole, tokens[:1])
        pairs = []
        for way, alone in ways.items():
            rows, traces = shared(alone, tokens[:1])
            pairs.append((0, rows[0], one_call[0], f"{way} against one call",
                          ((alone, tokens[:1], 0, traces), (whole, tokens[:1], 0, one_call_traces))))
    differences = []
    replayed: dict[tuple, list | None] = {}  # the traced replays of this check, so that a play shared by pairs runs once
    for k, rows, reference, against, sides in pairs:
        found = compare(rows, reference, dtype, k, against)
        if found is not None:
            found.schedule = schedule
            if locate:
                found.node, found.node_rows = first_node(adapter, documents, dtype, sides, replayed)
            differences.append(found)
    return Verdict(sum(len(rows) for _, rows, _, _, _ in pairs), differences)


def first_node(adapter, documents: Documents, dtype: str, sides, replayed: dict) -> tuple[str, int]:
    """Compare both sides of a difference node by node, in the graph's order: the first node where the
    sequence's rows differ and how many do, as a trace's first departing node is found.  A side played
    without its trace is replayed with one (``replayed``: those so far, by side, schedule and tokens).
    ("", 0) when the session gives no trace (``traced_step``) or the traced plays agree (run variance
    need not recur)."""
    both = []
    for side, (schedule, tokens, index, traces) in enumerate(sides):
        if traces is None:
            key = (side, case_json(schedule), b"".join(t.tobytes() for t in tokens))
            if key not in replayed:
                replayed[key] = play(adapter, schedule, tokens, documents, dtype, trace=True)[3]
            traces = replayed[key]
        if traces is None:
            return "", 0
        both.append(traces[index])
    a, b = both
    for node in nodes(documents.config):
        found = compare(a[node], b[node], dtype, 0, "") if node in a and node in b else None
        if found is not None:
            return node, found.rows
    return "", 0


# ----------------------------------------------------------------------------------------- record

@dataclass
class InvarianceRecord:
    """Per backend, dtype and relation: whether it was claimed, what was compared, the worst difference."""

    backend: str
    dtype: str
    relation: str
    claimed: bool = False
    outcome: str = "not run"  # held, varies (not claimed, and it does not hold), failed (claimed), errored, unsupported
    schedules: int = 0
    rows: int = 0  # rows compared
    differing: int = 0  # of those, rows that differ
    worst: Difference | None = None  # the difference of the most ULPs at the row's scale
    message: str = ""
    rerun: str = ""
    first_node: str = ""  # where the kept difference begins: "node, N rows" ("" when not located)

    def add(self, verdict: Verdict) -> None:
        self.schedules += 1
        self.rows += verdict.rows
        self.differing += sum(d.rows for d in verdict.differences)
        for d in verdict.differences:
            if self.worst is None or d.scaled > self.worst.scaled:
                self.worst = d

    def varied(self, message: str, rerun: str, first: Difference | None = None) -> None:
        """A difference: a failure when claimed, a measurement otherwise (the first is kept, as the one to rerun,
        with ``first``, its located difference first in the graph)."""
        if self.outcome not in ("failed", "varies", "errored"):
            self.outcome, self.message, self.rerun = ("failed" if self.claimed else "varies"), message, rerun
            self.first_node = first.first() if first else ""


def broken_claims(records, excused: dict) -> list[str]:
    """Each claimed relation that does not hold and no known deviation excuses (``excused``: (backend, dtype,
    "invariance:relation") -> its reason), as "backend dtype relation": what the exit line names."""
    ordered = sorted(records, key=lambda r: (r.backend, r.dtype, r.relation))
    return [f"{r.backend} {r.dtype} {r.relation}" for r in ordered
            if r.outcome == "failed" and (r.backend, r.dtype, f"invariance:{r.relation}") not in excused]


# ----------------------------------------------------------------------------------------- op by op

# How many nodes of each op a forward checks: the first ones (a layer of each kind holds every op).
NODES_PER_OP = 2


@dataclass
class OpInvarianceRecord:
    """Per backend, dtype and op: the whole call repeated, then (where it repeats) rows computed alone (or
    in blocks) against in the whole call.  A node whose call does not repeat is run variance, not batch
    dependence: its rows are not split."""

    backend: str
    dtype: str
    op: str
    nodes: int = 0
    rows: int = 0
    differing: int = 0
    scaled: float = 0.0  # the largest difference, in ULPs at the row's scale (Difference)
    ulps: float = 0.0  # the same, value by value
    where: str = ""  # the first difference: node and how the rows were split
    repeated: int = 0  # rows of whole calls computed a second time
    unrepeated: int = 0  # of those, rows that differ from the first time
    run_where: str = ""  # the first node whose call did not repeat

    @property
    def held(self) -> bool:
        return self.differing == 0

    @property
    def repeats(self) -> bool:
        return self.unrepeated == 0


def _row_args(op: str) -> list[bool]:
    """Which arguments have the op's rows as their leading axis (the keys of attention do not)."""
    return [a.kind in ("float", "index", "mask") and a.shape.split()[0] in ("...", "T", "S") for a in CONTRACT[op].args]


class OpInvariance(AdapterOps):
    """An adapter's ops for one forward that also checks each op's first nodes for batch invariance."""

    def __init__(self, adapter, dtype: str):
        super().__init__(adapter, dtype)
        self.records: dict[str, OpInvarianceRecord] = {}

    def op(self, node, name, *args):
        out = super().op(node, name, *args)
        record = self.records.setdefault(name, OpInvarianceRecord(self.name, self.dtype, name))
        rowwise = _row_args(name)
        if record.nodes < NODES_PER_OP and any(rowwise) and len(out) > 1:
            record.nodes += 1
            again = compare(super().op(node, name, *args), out, self.dtype, 0, "")
            record.repeated += len(out)
            if again is not None:  # run variance: a row alone would differ whatever the batch
                record.run_where = record.run_where or f"{node}: the call of {len(out)} rows repeated"
                record.unrepeated += again.rows
                return out
            for M in (1, *OPS[name].blocks):
                for start in range(0, len(out), M):
                    rows = slice(start, min(start + M, len(out)))
                    self._compare(record, node, name, args, rowwise, out, rows, M)
        return out

    def _compare(self, record, node, name, args, rowwise, out, rows, M):
        part = [a[rows] if r else a for a, r in zip(args, rowwise)]
        if OPS[name].prefill:  # a forward's keys sit at positions 0..T-1: those it sees
            *head, pos, q, k, v = part
            part = [*head, pos, q, k[:pos.max() + 1], v[:pos.max() + 1]]
        alone = super().op(node, name, *part)
        found = compare(alone, out[rows], self.dtype, 0, "")
        record.rows += len(alone)
        if found is not None:
            if not record.differing:
                record.where = f"{node}: rows {rows.start}..{rows.stop - 1} " + (
                    "alone" if M == 1 else f"in a block of {M}") + f" against in a call of {len(out)}"
            record.differing += found.rows
            record.scaled, record.ulps = max(record.scaled, found.scaled), max(record.ulps, found.ulps)


def op_invariance(adapter, documents: Documents, dtype: str, tokens: int) -> list[OpInvarianceRecord]:
    """Every op of a forward over the first ``tokens`` tokens of document 0, checked at its first nodes."""
    ops = OpInvariance(adapter, dtype)
    forward(ops, documents.config, documents.weights, documents.tokens[0][:tokens])
    return [r for r in ops.records.values() if r.nodes]
