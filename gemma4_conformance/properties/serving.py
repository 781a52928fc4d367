"""The serving path: schedules of KV-cache decoding, chunked prefill and continuous batching played on
an adapter's ``session`` (``schedules``, ``every_feature``, ``run``), every returned logit row judged
against the reference (``judge``), and ``--case`` schedules checked (``validate``).

The verdict is explained in docs/verdict.md (the serving path), the session's contract in
docs/adapter.md (the session).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache

import numpy as np
from hypothesis import strategies as st

from gemma4_conformance.adapters.contract import ContractViolation, check_step
from gemma4_conformance.composition.graph import composed
from gemma4_conformance.composition.session import open_session
from gemma4_conformance.spec import format_of

from .forward import ACCUMULATED, FLOOR, baseline_ops, drawn_tokens, judge_forward, reference, relative_error

SERVING_DTYPES = ("float32", "bfloat16")
# A session returns logits only, so a sequence's rows are judged as the forward judges an engine's
# accumulated errors, at forward.ACCUMULATED x the baseline's (docs/verdict.md, the serving path).
DOCUMENTS = 8  # as many as sequences may be live at once, so concurrent sequences never share tokens
MAX_SEQUENCES = 8
MAX_STEPS = 16
EXAMPLES_SHARE = 8  # a schedule is ~10 runs of the 48-layer model: an eighth of the profile's examples
FEATURES = ("chunking", "wrap-around", "reuse", "mixed batch")


# ----------------------------------------------------------------------------------------- schedules

def limits(window: int) -> dict:
    """Prompts up to 4 windows (in chunks of up to 2), then up to window - 2 decode steps (each a
    whole step of the model, so fewer than tokens): a sequence wraps its rings up to 4 times."""
    return {"prompt": 4 * window, "chunk": 2 * window, "decode": window - 2, "join": 3}


def document_length(window: int) -> int:
    lim = limits(window)
    return lim["prompt"] + lim["decode"]


def _end(sequence: dict) -> int:
    """The last step a sequence takes part in."""
    return sequence["join"] + len(sequence["chunks"]) + sequence["decode"] - 1


def normalize(schedule: dict, window: int) -> dict:
    """The schedule as it runs: prompts trimmed to the limit, a reused id joining only after the
    sequence that held it was released, sequences that would run past MAX_STEPS dropped (the first
    is kept).  Idempotent, so a printed schedule replays as it ran."""
    lim, sequences, released = limits(window), [], {}
    for s in schedule["sequences"]:
        chunks, room = [], lim["prompt"]
        for c in s["chunks"]:
            if room > 0:
                chunks.append(min(c, room))
                room -= chunks[-1]
        s = {"id": s["id"], "join": max(s["join"], released.get(s["id"], 0)), "chunks": chunks,
             "decode": s["decode"]}
        if sequences and _end(s) >= MAX_STEPS:
            continue
        sequences.append(s)
        released[s["id"]] = _end(s) + 1
    return {"sequences": sequences}


def schedules(window: int):
    """Schedules of 1 to 8 sequences: ids from a pool of 8 (so reused), joins staggered over the first
    steps, prompts of 1 to 4 windows in one piece or in up to 3 chunks of any size (window multiples
    or not), 0 to window - 2 decode steps.  Shrinks towards fewer, shorter, earlier sequences."""
    lim = limits(window)
    sequence = st.fixed_dictionaries({
        "id": st.integers(0, MAX_SEQUENCES - 1),
        "join": st.integers(0, lim["join"]),
        "chunks": st.lists(st.integers(1, lim["chunk"]), min_size=1, max_size=3),
        "decode": st.integers(0, lim["decode"]),
    })
    return st.lists(sequence, min_size=1, max_size=MAX_SEQUENCES).map(
        lambda sequences: normalize({"sequences": sequences}, window))


def every_feature(window: int) -> dict:
    """The schedule every run checks first (as the op tests check their edge cases): two sequences
    joining in one step, a prompt longer than the window in one piece and others in chunks that do
    not divide it (one starting after the ring wrapped), mixed prefill and decode steps, a released
    id and slot reused, and positions past 3 windows."""
    W = window
    return normalize({"sequences": [
        {"id": 0, "join": 0, "chunks": [W - 3, W - 2, 3, W - 1], "decode": W - 2},
        {"id": 1, "join": 0, "chunks": [W + 1], "decode": 3},
        {"id": 2, "join": 2, "chunks": [2], "decode": 4},
        {"id": 1, "join": 5, "chunks": [W // 2, W + 3], "decode": 3},
    ]}, window)


def validate(case, window: int) -> dict:
    """A schedule given with --case, checked (a clear error rather than a KeyError mid-run)."""
    def fail(why):
        raise ValueError(f"--case is not a serving schedule: {why}; expected "
                         '{"sequences": [{"id": 0, "join": 0, "chunks": [5, 3], "decode": 4}, ...]}')

    if not isinstance(case, dict) or not isinstance(case.get("sequences"), list) or not case["sequences"]:
        fail("no non-empty list 'sequences'")
    for i, s in enumerate(case["sequences"]):
        if not isinstance(s, dict) or set(s) != {"id", "join", "chunks", "decode"}:
            fail(f"sequences[{i}] needs exactly id, join, chunks and decode")
        numbers = [s["id"], s["join"], s["decode"], *s["chunks"]] if isinstance(s["chunks"], list) else []
        if not s["chunks"] or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in numbers) \
                or min(s["chunks"]) < 1:
            fail(f"sequences[{i}]: id, join and decode are integers >= 0, chunks a non-empty list of sizes >= 1")
        if s["decode"] > limits(window)["decode"] or sum(s["chunks"]) > limits(window)["prompt"]:
            fail(f"sequences[{i}] is longer than a document: prompts of up to {limits(window)['prompt']} tokens, "
                 f"up to {limits(window)['decode']} decode steps")
    return normalize(case, window)


@dataclass(frozen=True)
class Piece:
    """What one sequence appends in one step."""

    sequence: int  # its index in the schedule
    start: int  # its length before the step
    n: int
    decode: bool


def steps(schedule: dict) -> list[tuple[dict[int, Piece], list[int]]]:
    """Per step: id -> the piece that sequence appends, and the ids released after the step (a step
    in which no sequence is live is skipped)."""
    out = [({}, []) for _ in range(max(_end(s) for s in schedule["sequences"]) + 1)]
    for k, s in enumerate(schedule["sequences"]):
        sizes = [(c, False) for c in s["chunks"]] + [(1, True)] * s["decode"]
        start = 0
        for t, (n, decode) in enumerate(sizes, s["join"]):
            out[t][0][s["id"]] = Piece(k, start, n, decode)
            start += n
        out[_end(s)][1].append(s["id"])
    return [step for step in out if step[0]]


def length(sequence: dict) -> int:
    return sum(sequence["chunks"]) + sequence["decode"]


def features(schedule: dict, window: int) -> list[str]:
    """Which of FEATURES the schedule has: a prompt in several chunks; a sequence longer than the
    window (its ring overwritten); an id used twice; a step with both prefill and decode pieces."""
    sequences = schedule["sequences"]
    ids = [s["id"] for s in sequences]
    mixed = any(len({p.decode for p in batch.values()}) == 2 for batch, _ in steps(schedule))
    found = {"chunking": any(len(s["chunks"]) > 1 for s in sequences),
             "wrap-around": any(length(s) > window for s in sequences),
             "reuse": len(set(ids)) < len(ids), "mixed batch": mixed}
    return [f for f in FEATURES if found[f]]


def case_json(schedule: dict) -> str:
    return json.dumps(schedule, separators=(",", ":"))


# ----------------------------------------------------------------------------------------- documents

class Documents:
    """The token lists sequences read, with their reference and baseline prefills (computed once,
    when first needed): document d's logits at position p judge every sequence reading d at p."""

    def __init__(self, weights, checkpoint=None, seed: int = 0):
        self.weights, self.config, self.checkpoint = weights, weights.config, checkpoint
        window = min(l.window for l in self.config.layers if l.kind == "sliding")
        self.window, self.length = window, document_length(window)
        self.tokens = [drawn_tokens(self.config.vocab_size, self.length, seed * DOCUMENTS + d) for d in range(DOCUMENTS)]

    @cache
    def reference(self, d: int) -> np.ndarray:
        result, _ = reference(self.config, self.weights, self.tokens[d], certify=False)
        return result["logits"]

    @cache
    def baseline(self, d: int, dtype: str, formats: tuple = ()) -> np.ndarray:
        """The plain baseline's logits, rounding as an engine declares (``formats``: its items)."""
        plain = baseline_ops(dict(formats))
        return composed(plain, self.config, self.weights, self.tokens[d], dtype)["logits"]

    def of(self, k: int, sequence: dict) -> np.ndarray:
        """The tokens sequence k of a schedule appends, in order."""
        return self.tokens[k % DOCUMENTS][:length(sequence)]


# ----------------------------------------------------------------------------------------- running

def _call(what: str, fn, *args):
    try:
        return fn(*args)
    except ContractViolation:
        raise
    except Exception as e:
        raise ContractViolation(f"{what} raised {type(e).__name__}: {e}") from e


def _close(session):
    if hasattr(session, "close"):
        _call("session.close()", session.close)


@dataclass
class Run:
    """What a session returned for a schedule: per sequence its stepped rows (in order), whether
    each row came from a decode step, and its own one-call prefill of the same tokens."""

    stepped: list[np.ndarray]
    decoded: list[np.ndarray]
    prefilled: list[np.ndarray]
    steps: int


def play(adapter, schedule: dict, tokens: list[np.ndarray], documents: Documents, dtype: str, trace: bool = False,
         plain_only: bool = False):
    """Play ``schedule`` on a fresh session, sequence k appending ``tokens[k]``: per sequence its rows
    in order, whether each came from a decode step, the steps taken, and (with ``trace``, where the
    session has ``traced_step``; else None) per sequence its trace: node -> its rows of every step, in order.
    With ``plain_only`` too, only where the session's traced steps are its plain ones
    (``traced_steps_are_plain``), so that the rows stand for a plain play's."""
    vocab = documents.config.vocab_size
    pieces: list[list] = [[] for _ in schedule["sequences"]]
    decoded: list[list] = [[] for _ in schedule["sequences"]]
    plan = steps(schedule)
    session = open_session(adapter, documents.weights, documents.config.raw, dtype, documents.checkpoint)
    traced = trace and hasattr(session, "traced_step") and (
        not plain_only or getattr(session, "traced_steps_are_plain", False))
    traces: list[dict] = [{} for _ in schedule["sequences"]]
    for t, (batch, released) in enumerate(plan):
        given = {seq: tokens[p.sequence][p.start:p.start + p.n] for seq, p in batch.items()}
        where = f"{adapter.name} session.step #{t} of the schedule"
        out, nodes = _call(where, session.traced_step, given) if traced else (_call(where, session.step, given), {})
        check_step(out, given, vocab, dtype, where)
        for seq, p in batch.items():
            pieces[p.sequence].append(out[seq])
            decoded[p.sequence].append(np.full(p.n, p.decode))
            for node, rows in nodes.get(seq, {}).items():
                traces[p.sequence].setdefault(node, []).append(rows)
        for seq in released:
            _call(f"session.release({seq}) after step #{t}", session.release, seq)
    _close(session)
    joined = [{node: np.concatenate(parts) for node, parts in t.items()} for t in traces] if traced else None
    return [np.concatenate(p) for p in pieces], [np.concatenate(d) for d in decoded], len(plan), joined


def run(adapter, schedule: dict, documents: Documents, dtype: str) -> Run:
    """Play ``schedule`` on a fresh session, then prefill every sequence in one call on another."""
    vocab = documents.config.vocab_size
    tokens = [documents.of(k, s) for k, s in enumerate(schedule["sequences"])]
    stepped, decoded, taken, _ = play(adapter, schedule, tokens, documents, dtype)
    session = open_session(adapter, documents.weights, documents.config.raw, dtype, documents.checkpoint)
    given = dict(enumerate(tokens))
    where = f"{adapter.name} session.step (one-call prefill of every sequence)"
    out = _call(where, session.step, given)
    check_step(out, given, vocab, dtype, where)
    _close(session)
    return Run(stepped, decoded, [out[k] for k in range(len(tokens))], taken)


class LogitRows:
    """An ops object whose LM head computes only ``rows`` (the graph is otherwise unchanged): a long
    prefill's reference at the real vocabulary (262144) keeps the rows a verdict reads, not [T, V]."""

    def __init__(self, ops, rows):
        self.ops, self.rows, self.name = ops, np.asarray(rows), ops.name

    def op(self, node, name, *args):
        if node == "logits":
            *head, x = args
            args = (*head, x[self.rows])
        return self.ops.op(node, name, *args)

    def weight(self, array):
        return self.ops.weight(array)


# ----------------------------------------------------------------------------------------- verdict

@dataclass
class Position:
    """One logit row against the reference: its relative error, the baseline's, and the ratio to
    what the verdict allows a row (ACCUMULATED x the baseline's error, or the floor)."""

    ratio: float
    error: float
    baseline: float
    sequence: int
    position: int
    decode: bool
    schedule: dict | None = None


@dataclass
class ScheduleVerdict:
    failures: list[str]
    worst: Position
    sequences: int
    tokens: int
    steps: int


def worst_row(rows, baseline, ref, dtype: str, k: int, decoded) -> Position:
    floor = FLOOR * format_of(dtype).eps
    best = None
    for p in range(len(rows)):
        ec, eb = relative_error(rows[p], ref[p]), relative_error(baseline[p], ref[p])
        ratio = ec / max(ACCUMULATED * eb, floor)
        if best is None or ratio > best.ratio:
            best = Position(ratio, ec, eb, k, p, bool(decoded[p]))
    return best


def judge(result: Run, schedule: dict, documents: Documents, dtype: str, formats: dict | None = None) -> ScheduleVerdict:
    """forward.judge_forward on each sequence's rows: against the reference (with the baseline's
    allowance: the baseline rounds as the engine's declared ``formats`` say), and against the session's own
    one-call prefill."""
    failures, worst = [], None
    for k, s in enumerate(schedule["sequences"]):
        L, d = length(s), k % DOCUMENTS
        rows, ref, base = result.stepped[k], documents.reference(d)[:L], documents.baseline(d, dtype, tuple(sorted((formats or {}).items())))[:L]
        name = f"sequence {k} (id {s['id']}, {L} tokens, document {d})"
        verdict = judge_forward({"logits": rows}, {"logits": base}, {"logits": ref}, dtype, accumulated=ACCUMULATED)
        failures += [f"{name} against the reference: {f}" for f in verdict.failures]
        # The relation in the same verdict: the stepped rows' departure from the session's own prefill,
        # laid on the reference, against the baseline's error. Both are runs of the engine, each within
        # ACCUMULATED x the baseline's error of the exact logits (the check above), rounded differently
        # (the chunks and the batch change the shape of every product): up to the sum of two such errors.
        departure = ref + (rows.astype(np.float64) - result.prefilled[k].astype(np.float64))
        relation = judge_forward({"logits": departure}, {"logits": base}, {"logits": ref}, dtype,
                                 accumulated=2 * ACCUMULATED)
        failures += [f"{name} stepped against the session's own one-call prefill: {f}" for f in relation.failures]
        row = worst_row(rows, base, ref, dtype, k, result.decoded[k])
        if worst is None or row.ratio > worst.ratio:
            worst = row
    worst.schedule = schedule
    return ScheduleVerdict(failures, worst, len(schedule["sequences"]),
                           sum(length(s) for s in schedule["sequences"]), result.steps)


# ----------------------------------------------------------------------------------------- record

@dataclass
class ServingRecord:
    """Per backend and dtype: what the serving test checked, the worst row, and its failing schedules."""

    backend: str
    dtype: str
    outcome: str = "not run"  # passed, failed, errored, unsupported
    schedules: int = 0
    sequences: int = 0
    steps: int = 0
    tokens: int = 0
    worst: Position | None = None
    failing: int = 0  # failing schedules judged (Hypothesis's shrinking included)
    failing_features: dict = field(default_factory=lambda: {f: 0 for f in FEATURES})
    case: dict | None = None  # the last failing (or breaking) schedule: Hypothesis replays the minimal one last
    features: list = field(default_factory=list)  # that schedule's features
    message: str = ""
    rerun: str = ""

    def add(self, verdict: ScheduleVerdict) -> None:
        self.schedules += 1
        self.sequences += verdict.sequences
        self.steps += verdict.steps
        self.tokens += verdict.tokens
        if self.worst is None or verdict.worst.ratio > self.worst.ratio:
            self.worst = verdict.worst

    def fail(self, schedule: dict, window: int, message: str, rerun: str, broke: bool = False) -> None:
        found = features(schedule, window)
        if broke or self.outcome != "errored":
            self.outcome = "errored" if broke else "failed"
            self.case, self.features, self.message, self.rerun = schedule, found, message, rerun
        if not broke:
            self.failing += 1
            for f in found:
                self.failing_features[f] += 1
