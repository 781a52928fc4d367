"""What a run measured: per backend x dtype x op the examples, error distribution, worst case and outcome;
per backend x dtype x relation the outcome; the forward and trace verdicts; what was excused and what broke."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pytest

from gemma4_conformance.properties.forward import ForwardVerdict
from gemma4_conformance.properties.invariance import Difference, InvarianceRecord, OpInvarianceRecord
from gemma4_conformance.properties.serving import Position, ServingRecord
from gemma4_conformance.properties.trace import NodeVerdict, TraceVerdict
from gemma4_conformance.spec import OP_NAMES

# Informative examples an op x dtype needs to count as established: an example whose allowance admits
# a trivially wrong answer (zeros, the sign flipped, attention's uniform weights or a zeroed head)
# passed, but says nothing about whether the backend computes the op.
MIN_INFORMATIVE = 3


class UnsupportedSkip(pytest.skip.Exception):
    """A test skipped because the adapter lacks what it needs (an op, a forward, a session): the plugin
    names the adapter's unsupported ops once in its summary, not once per test in pytest's."""


def reported(outcome: str, deviation: str) -> str:
    """The outcome as reported: a failure a known-deviations entry covers (``deviation``, its reason)
    is a "known deviation"."""
    return "known deviation" if deviation and outcome == "failed" else outcome


@dataclass
class OpRecord:
    backend: str
    dtype: str
    op: str
    examples: int = 0
    # The worst example is the one with the least headroom (its error over its budget is largest); a
    # budget depends on the example's dimensions, so it need not be the example with the largest error.
    budget: float = 0.0  # the worst example's budget, in ULPs at the scale
    worst_ulps: float = 0.0  # the worst example's error
    worst_case: dict | None = None
    worst_command: str = ""
    per_example: list[float] = field(default_factory=list)  # each example's largest error in ULPs
    fractions: list[float] = field(default_factory=list)  # each example's largest error over its budget
    outcome: str = "not run"  # passed, failed, unsupported, errored, not established
    message: str = ""  # why the worst example failed, why the op errored, or why the adapter refused it
    informative: int = 0  # examples whose allowance excluded every trivially wrong answer
    seconds: dict[str, float] = field(default_factory=lambda: {"backend": 0.0, "transfer": 0.0, "oracle": 0.0})
    checked: int = 0  # output elements judged
    by_oracle: int = 0  # of those, the ones the first stage's enclosures left to the oracle
    # The adapter's declared formats whose terms the op's allowance held (key -> format), and in how many
    # examples those terms were most of the allowance where the error was largest
    formats: dict[str, str] = field(default_factory=dict)
    dominated: int = 0
    outside: int = 0  # examples a declared format cannot hold (judging.BeyondDeclared), not judged

    def declared(self, formats: dict[str, str], dominates: bool) -> None:
        """Count one example's declared terms (``judging.Verdict.formats``, ``declared_dominates``)."""
        self.formats.update(formats)
        self.dominated += dominates

    @property
    def given(self) -> str:
        """"" where nothing was declared; else the verdict's qualification, its formats and where they dominate."""
        if not self.formats:
            return ""
        listed = ", ".join(f"{key} {name}" for key, name in sorted(self.formats.items()))
        beyond = (f"; {self.outside} example{'s' * (self.outside != 1)} beyond the formats' range not judged"
                  if self.outside else "")
        return (f"given its declared formats ({listed}; their terms are most of the allowance in "
                f"{self.dominated} of {self.examples} examples{beyond})")

    def judged(self, checked: int, by_oracle: int) -> None:
        self.checked += checked
        self.by_oracle += by_oracle

    def timed(self, seconds: dict[str, float]) -> None:
        """Add one example's wall seconds (backend, transfer, oracle: judging.Verdict.seconds)."""
        for part, value in seconds.items():
            self.seconds[part] += value

    def add(self, ulps: float, budget: float, case: dict, command: str, informative: bool = True) -> bool:
        """Count one example; returns whether it is now the worst (once the op broke, the case it broke
        on stays the one to rerun)."""
        self.examples += 1
        self.informative += informative
        self.per_example.append(ulps)
        self.fractions.append(ulps / budget)
        if self.outcome == "errored" or not (self.worst_case is None or ulps / budget > self.worst_ulps / self.budget):
            return False
        self.worst_ulps, self.budget, self.worst_case, self.worst_command = ulps, budget, case, command
        return True

    def broke(self, message: str, case: dict, command: str) -> None:
        """The backend broke the contract on ``case``: that outweighs any failure, and is what to rerun."""
        self.outcome, self.message, self.worst_case, self.worst_command = "errored", message, case, command

    def fail(self, message: str, worst: bool) -> None:
        """An example beyond its budget (``worst``: the worst so far): the op failed, unless it broke."""
        if self.outcome != "errored":
            self.outcome = "failed"
            if worst:  # the report's message, error and rerun command all describe the same example
                self.message = message

    @property
    def max_ulps(self) -> float:
        return max(self.per_example, default=0.0)

    @property
    def headroom(self) -> float:
        """The worst example's budget over its error: above 1 passes; how much room is left."""
        return self.budget / self.worst_ulps if self.worst_ulps else float("inf")

    def quantile(self, q: float) -> float:
        if not self.per_example:
            return 0.0
        with np.errstate(invalid="ignore"):
            value = float(np.quantile(self.per_example, q))
        # numpy's interpolation towards an inf error gives NaN (inf - inf); the errors are >= 0 and not
        # NaN, so the quantile there is the inf itself
        return np.inf if np.isnan(value) else value


@dataclass
class RelationRecord:
    backend: str
    dtype: str
    relation: str
    ops: tuple[str, ...]
    examples: int = 0
    outcome: str = "not run"  # passed, failed, unsupported, errored
    message: str = ""
    rerun: str = ""


@dataclass
class Problem:
    """A test that broke rather than failed: the adapter raised or broke the contract, or the suite errored."""

    test: str  # pytest node id
    phase: str  # setup, call or teardown
    message: str


def serving_summary(r) -> str:
    """One line on a backend x dtype's serving path: what was checked, the worst row, what failed."""
    if r.outcome == "unsupported":
        return "no session: the serving path is not supported"
    text = f"{r.schedules} schedules, {r.sequences} sequences, {r.steps} steps, {r.tokens} tokens"
    if r.worst is not None:
        w = r.worst
        text += (f"; worst row: position {w.position} ({'decode' if w.decode else 'prefill'}), rel. error "
                 f"{w.error:.3g} (baseline {w.baseline:.3g}), {w.ratio:.2g} of allowed")
    if r.outcome in ("failed", "errored"):
        text += f"; the last failing schedule has {', '.join(r.features) or 'none of the features'}"
    return text


def invariance_lines(relations, ops, excused: dict | None = None) -> list[str]:
    """The terminal summary's invariance lines: per backend and dtype, each relation's outcome (claimed
    or measured; a broken claim that ``excused`` covers is a known deviation) and worst difference, and
    the ops that are not batch-invariant."""
    lines = []
    for r in sorted(relations, key=lambda r: (r.backend, r.dtype, r.relation)):
        outcome = reported(r.outcome, (excused or {}).get((r.backend, r.dtype, f"invariance:{r.relation}"), ""))
        what = f"{outcome} ({'claimed' if r.claimed else 'not claimed'})"
        text = f"{r.schedules} schedules, {r.differing} of {r.rows} rows differ"
        if r.worst is not None:
            text += f"; worst: sequence {r.worst.sequence} from position {r.worst.position}, {r.worst.describe()}"
        if r.first_node:
            text += f"; breaks first at {r.first_node}"
        lines.append(f"{r.backend:<8} {r.dtype:<9} {'invariance:' + r.relation:<15} {what:<15} {text}")
    varying: dict[tuple[str, str], list[str]] = {}
    unrepeated: dict[tuple[str, str], list[str]] = {}
    for r in sorted(ops, key=lambda r: (r.backend, r.dtype, r.op)):
        if not r.held:
            varying.setdefault((r.backend, r.dtype), []).append(f"{r.op} ({r.scaled:.3g} ULPs at the row's scale, "
                                                                f"{r.ulps:.3g} value by value)")
        if not r.repeats:
            unrepeated.setdefault((r.backend, r.dtype), []).append(f"{r.op} ({r.unrepeated} of {r.repeated} rows)")
    for label, found in (("not batch-inv.", varying), ("varies run to run", unrepeated)):
        for (backend, dtype), names in sorted(found.items()):
            lines.append(f"{backend:<8} {dtype:<9} {label:<15} {', '.join(names)}")
    return lines


class Recorder:
    def __init__(self):
        self.records: dict[tuple[str, str, str], OpRecord] = {}
        self.relations: dict[tuple[str, str, str], RelationRecord] = {}
        self.forward: dict[tuple[str, str], object] = {}  # (backend, dtype) -> forward.ForwardVerdict
        self.traces: dict[tuple[str, str], object] = {}  # (backend, dtype) -> trace.TraceVerdict
        self.serving: dict[tuple[str, str], object] = {}  # (backend, dtype) -> serving.ServingRecord
        # (backend, dtype, relation) -> invariance.InvarianceRecord; (backend, dtype, op) -> OpInvarianceRecord
        self.invariance: dict[tuple[str, str, str], object] = {}
        self.op_invariance: dict[tuple[str, str, str], object] = {}
        self.excused: dict[tuple[str, str, str], str] = {}  # (backend, dtype, op/relation/"forward") -> reason
        self.problems: list[Problem] = []

    def __call__(self, backend: str, dtype: str, op: str) -> OpRecord:
        key = (backend, dtype, op)
        if key not in self.records:
            self.records[key] = OpRecord(backend, dtype, op)
        return self.records[key]

    def relation(self, backend: str, dtype: str, name: str, ops: tuple[str, ...]) -> RelationRecord:
        key = (backend, dtype, name)
        if key not in self.relations:
            self.relations[key] = RelationRecord(backend, dtype, name, ops)
        return self.relations[key]

    def export(self) -> dict:
        """Everything recorded, as plain data: what a pytest-xdist worker sends to the controller."""
        return {"records": [asdict(r) for r in self.records.values()],
                "relations": [asdict(r) for r in self.relations.values()],
                "forward": [[backend, dtype, asdict(v)] for (backend, dtype), v in self.forward.items()],
                "traces": [[backend, dtype, asdict(v)] for (backend, dtype), v in self.traces.items()],
                "serving": [asdict(r) for r in self.serving.values()],
                "invariance": [asdict(r) for r in self.invariance.values()],
                "op_invariance": [asdict(r) for r in self.op_invariance.values()],
                "excused": [[*key, reason] for key, reason in self.excused.items()],
                "problems": [asdict(p) for p in self.problems]}

    def merge(self, data: dict) -> None:
        """Add what another process recorded (``export``'s data): each test runs in one worker, so the
        tests' records do not overlap."""
        for r in data["records"]:
            record = OpRecord(**r)
            self.records[record.backend, record.dtype, record.op] = record
        for r in data["relations"]:
            record = RelationRecord(**{**r, "ops": tuple(r["ops"])})
            self.relations[record.backend, record.dtype, record.relation] = record
        for backend, dtype, v in data["forward"]:
            pair = (lambda p: None if p is None else tuple(p))
            self.forward[backend, dtype] = ForwardVerdict(**{**v, "layers": [tuple(e) for e in v["layers"]],
                                                              "logits": tuple(v["logits"]),
                                                              "logprob_gap": tuple(v["logprob_gap"]),
                                                              "local_layers": [tuple(e) for e in v["local_layers"]],
                                                              "local_logits": pair(v["local_logits"]),
                                                              "local_logprob_gap": pair(v["local_logprob_gap"])})
        for backend, dtype, v in data["traces"]:
            self.traces[backend, dtype] = TraceVerdict(**{**v, "nodes": [NodeVerdict(**n) for n in v["nodes"]]})
        for r in data["serving"]:
            worst = None if r["worst"] is None else Position(**r["worst"])
            self.serving[r["backend"], r["dtype"]] = ServingRecord(**{**r, "worst": worst})
        for r in data.get("invariance", []):  # absent from a worker of an older suite
            worst = None if r["worst"] is None else Difference(**r["worst"])
            self.invariance[r["backend"], r["dtype"], r["relation"]] = InvarianceRecord(**{**r, "worst": worst})
        for r in data.get("op_invariance", []):
            self.op_invariance[r["backend"], r["dtype"], r["op"]] = OpInvarianceRecord(**r)
        for backend, dtype, subject, reason in data["excused"]:
            self.excused[backend, dtype, subject] = reason
        self.problems.extend(Problem(**p) for p in data["problems"])

    def outcome(self, backend: str, dtype: str, subject: str, outcome: str) -> str:
        return reported(outcome, self.excused.get((backend, dtype, subject), ""))

    def unsupported(self) -> dict[str, list[str]]:
        """Per backend that lacks something, the ops it does not implement, in the contract's order."""
        found = {r.backend: set() for r in self.serving.values() if r.outcome == "unsupported"}
        for r in self.records.values():
            if r.outcome == "unsupported" and not r.message:  # a refusal has its own line (``table``)
                found.setdefault(r.backend, set()).add(r.op)
        return {backend: [op for op in OP_NAMES if op in ops] for backend, ops in sorted(found.items())}

    def table(self) -> list[str]:
        """The terminal summary: one line per backend x dtype x op, the forward verdicts, failed relations."""
        lines = [f"{'backend':<8} {'dtype':<9} {'op':<15} {'outcome':<15} {'examples':>8} {'inform.':>7} "
                 f"{'ULPs':>10} {'budget':>9} {'headroom':>9}"]
        for r in sorted(self.records.values(), key=lambda r: (r.backend, r.dtype, r.op)):
            if r.outcome == "unsupported":  # an op not implemented: one line per backend, below
                if r.message:  # arguments the adapter refused: why
                    lines.append(f"{r.backend:<8} {r.dtype:<9} {r.op:<15} {r.outcome:<15} {r.message}")
                continue
            outcome = self.outcome(r.backend, r.dtype, r.op, r.outcome)
            lines.append(f"{r.backend:<8} {r.dtype:<9} {r.op:<15} {outcome:<15} {r.examples:>8} {r.informative:>7} "
                         f"{r.worst_ulps:>10.3g} {r.budget:>9.3g} {r.headroom:>9.3g}" + (f"  {r.given}" if r.given else ""))
        for (backend, dtype), v in sorted(self.forward.items()):
            if v.layers:
                worst = max(v.layers, key=lambda e: e[0] / max(e[1], 1e-300))
                layers = f"worst layer {worst[0]:.3g} (baseline {worst[1]:.3g})"
                if v.local_layers:
                    own = max(e[0] / max(e[1], 1e-300) for e in v.local_layers)
                    layers += f", worst layer's own error {own:.2g} x its baseline's"
            else:
                layers = "hidden states not provided"
            outcome = self.outcome(backend, dtype, "forward", "failed" if v.failures else "passed")
            lines.append(f"{backend:<8} {dtype:<9} {'forward':<15} {outcome:<15} "
                         f"logits rel. error {v.logits[0]:.3g} (baseline {v.logits[1]:.3g}), {layers}, "
                         f"top-1 agreement {v.top1_agreement:.0%}")
        for (backend, dtype), v in sorted(self.traces.items()):
            outcome = self.outcome(backend, dtype, "trace", "failed" if v.failures else "passed")
            lines.append(f"{backend:<8} {dtype:<9} {'trace':<15} {outcome:<15} {v.summary()}")
        for (backend, dtype), r in sorted(self.serving.items()):
            if r.outcome == "unsupported":  # in the backend's line below
                continue
            outcome = self.outcome(backend, dtype, "serving", r.outcome)
            lines.append(f"{backend:<8} {dtype:<9} {'serving':<15} {outcome:<11} " + serving_summary(r))
        for backend, ops in self.unsupported().items():
            missing = [f"{len(ops)} op{'s' * (len(ops) != 1)} not implemented, skipped with every test that "
                       f"needs them: {', '.join(ops)}"] if ops else []
            if any(r.outcome == "unsupported" for (b, _), r in self.serving.items() if b == backend):
                missing.append("no session, so no serving path")
            lines.append(f"{backend:<8} unsupported: {'; '.join(missing)}")
        lines += invariance_lines(self.invariance.values(), self.op_invariance.values(), self.excused)
        if self.relations:
            counts = {o: sum(r.outcome == o for r in self.relations.values()) for o in ("passed", "unsupported")}
            lines.append(f"theorems of the spec: {counts['passed']} held, "
                         f"{len(self.relations) - sum(counts.values())} did not, {counts['unsupported']} unsupported")
            for r in sorted(self.relations.values(), key=lambda r: (r.backend, r.dtype, r.relation)):
                if r.outcome not in ("passed", "unsupported"):
                    outcome = self.outcome(r.backend, r.dtype, r.relation, r.outcome)
                    lines.append(f"{r.backend:<8} {r.dtype:<9} {r.relation} {outcome}")
        return lines
