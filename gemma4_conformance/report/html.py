"""The HTML page: one or several report documents on one self-contained page.

``render(documents)`` returns the page as a string; ``write(path, documents)`` writes it.  The markup
comes from ``templates/report.html.j2`` with autoescaping on; the only unescaped strings are the SVGs
matplotlib draws (figures.py).  ``context`` computes what the template shows, a function per section of
the page, each named for it.  What the page shows, section by section: docs/report.md.
"""

from __future__ import annotations

import itertools
import json
import math
from functools import cache
from pathlib import Path

import jinja2

from gemma4_conformance.adapters import INVARIANCE
from gemma4_conformance.properties.table import OPS
from gemma4_conformance.spec import OP_NAMES
from gemma4_conformance.spec.model import LAYER_NODES

from .data import dtype_rank, number, validate
from .figures import forward_chart, histogram_chart
from .formatting import COLOURS, ONE_ROUNDING, PASSED, WARN_HEADROOM, examples, over, percent, shown, status

TEMPLATES = Path(__file__).with_name("templates")
CLOSEST_PER_COLUMN = 10  # passing ops listed per backend in "closest to budget"
SLACK_NOTE = 100  # a budget this many times the largest error any passing backend showed is marked


# ----------------------------------------------------------------------------------------- the layout

def _labels(documents: list[dict], labels) -> list[str]:
    """The documents' labels: as given, else each environment's ``label``, else its backends, else
    "report N"; made unique."""
    if labels is not None:
        if len(labels) != len(documents):
            raise ValueError(f"{len(labels)} labels for {len(documents)} documents")
    else:
        labels = [d["environment"].get("label")
                  or ", ".join(sorted({e["backend"] for e in d["results"] + d["forward"]}))
                  or f"report {i + 1}" for i, d in enumerate(documents)]
    labels = [str(label) for label in labels]
    return [f"{label} ({labels[:i].count(label) + 1})" if labels.count(label) > 1 else label
            for i, label in enumerate(labels)]


def setting(env: dict, backend: str) -> str:
    """Where ``backend`` ran and the math modes that decide its verdicts, in a line ("" when unknown)."""
    described = (env.get("backends") or {}).get(backend)
    if not isinstance(described, dict):
        return ""
    device, name = str(described.get("device", "")), described.get("device_name")
    where = device + (f" ({name})" if name and name not in (device, "cpu") else "")
    return "; ".join(part for part in (where, described.get("math_summary", "")) if part)


class Page:
    """The documents laid out as the sections share them: the columns, (document, backend) pairs in order
    of appearance, each labelled; the ops and dtypes; each kind of entry by its place; the anchors of the
    failing results (the matrix links to them); and the numbering of commands and charts, unique to the
    page and in the order the sections are computed."""

    def __init__(self, documents: list[dict], labels) -> None:
        self.documents = documents
        self.doc_labels = _labels(documents, labels)
        # A backend seen in several documents carries the document's label.
        self.seen_in: dict[str, set[int]] = {}
        for i, d in enumerate(documents):
            for entry in d["results"] + d["forward"] + d["traces"] + d["serving"]:
                self.seen_in.setdefault(entry["backend"], set()).add(i)
        self.columns, self.ops, self.cells = [], [], {}
        dtypes = set()
        for i, d in enumerate(documents):
            for r in d["results"]:
                if (i, r["backend"]) not in self.columns:
                    self.columns.append((i, r["backend"]))
                if r["op"] not in self.ops:
                    self.ops.append(r["op"])
                dtypes.add(r["dtype"])
                self.cells[i, r["backend"], r["dtype"], r["op"]] = r
        self.forward = _by_place(documents, "forward")
        self.trace = _by_place(documents, "traces")
        self.serving = _by_place(documents, "serving")
        self.relations, self.relation_names = {}, []
        for i, d in enumerate(documents):
            for r in d["relations"]:
                self.relations[i, r["backend"], r["dtype"], r["relation"]] = r
                if r["relation"] not in self.relation_names:
                    self.relation_names.append(r["relation"])
        self.dtypes = sorted(dtypes | {dt for _, _, dt in self.forward} | {dt for _, _, dt in self.trace}
                             | {r["dtype"] for d in documents for r in d["relations"]}, key=dtype_rank)
        # A backend with theorems, a forward or a trace and no ops still gets its column, after those with ops.
        others = [*((i, b) for i, b, _, _ in self.relations), *((i, b) for i, b, _ in [*self.forward, *self.trace])]
        for i, backend in others:
            if (i, backend) not in self.columns:
                self.columns.append((i, backend))
        self.column_labels = [self.label(i, b) for i, b in self.columns]
        # Failing results, worst first within a column and dtype: errored, then by how far over budget.
        self.failing = []
        for c, (i, backend) in enumerate(self.columns):
            for dtype in self.dtypes:
                failing = [r for r in self.results(i, backend, dtype) if status(r) == "fail"]
                failing.sort(key=lambda r: (r["outcome"] != "errored", -(over(r) or 0.0)))
                self.failing += [(c, dtype, r) for r in failing]
        self.anchors = {(self.columns[c][0], self.columns[c][1], dtype, r["op"]): f"fail-{n}"
                        for n, (c, dtype, r) in enumerate(self.failing, 1)}
        self._commands, self._charts = itertools.count(1), itertools.count(1)

    def label(self, i: int, backend: str) -> str:
        """The column's label: the backend, with the document's label when it occurs in several."""
        return f"{backend} · {self.doc_labels[i]}" if len(self.seen_in.get(backend, ())) > 1 else backend

    def results(self, i: int, backend: str, dtype: str) -> list[dict]:
        """The column's results of ``dtype``, in op order."""
        return [r for op in self.ops if (r := self.cells.get((i, backend, dtype, op))) is not None]

    def command(self, text: str) -> dict | None:
        """A rerun command with an id for its copy button; None when there is none."""
        return {"id": f"cmd-{next(self._commands)}", "text": text} if text else None

    def chart_prefix(self, kind: str) -> str:
        """A prefix that makes a chart's SVG ids unique to the page."""
        return f"{kind}{next(self._charts)}-"

    def setting(self, i: int, backend: str) -> str:
        """Where the column's backend ran and its math modes, in a line."""
        return setting(self.documents[i]["environment"], backend)


def _by_place(documents: list[dict], key: str) -> dict[tuple, dict]:
    """A document key's entries (one per backend and dtype) by (document, backend, dtype)."""
    return {(i, e["backend"], e["dtype"]): e for i, d in enumerate(documents) for e in d[key]}


def _in_order(entries: dict[tuple, dict]) -> list[tuple[tuple, dict]]:
    """``_by_place`` entries by document, backend, then dtype widest first."""
    return sorted(entries.items(), key=lambda kv: (kv[0][0], kv[0][1], dtype_rank(kv[0][2])))


# ----------------------------------------------------------------------------------------- the sections

def broken_section(page: Page) -> dict:
    """Tests where the adapter raised or the suite errored."""
    return {"problems": [{"label": page.doc_labels[i], **p} for i, d in enumerate(page.documents)
                         for p in d["problems"]]}


def failures_section(page: Page) -> dict:
    """Every failed or errored op, violated theorem, failed forward, departing trace and failed serving path,
    with its message and rerun command; and the failing backends' settings, once each."""
    failures = []
    for c, dtype, r in page.failing:
        i, backend = page.columns[c]
        failures.append({"anchor": page.anchors[i, backend, dtype, r["op"]], "column": page.column_labels[c],
                         "dtype": dtype, "op": r["op"], "outcome": r["outcome"], "worst": shown(r["worst_ulps"]),
                         "budget": shown(r["budget_ulps"]), "over": shown(over(r)) if over(r) is not None else None,
                         "examples": examples(r["examples"]), "formula": r["budget_formula"],
                         "message": r["message"], "rerun": page.command(r["rerun"]),
                         "setting": page.setting(i, backend)})
    forward_failures = [{"column": page.label(i, b), "dtype": dt, "failures": f["failures"],
                         "rerun": page.command(f["rerun"]), "setting": page.setting(i, b)}
                        for (i, b, dt), f in page.forward.items() if f["outcome"] == "failed"]
    trace_failures = [{"column": page.label(i, b), "dtype": dt, "summary": t["summary"], "failures": t["failures"],
                       "rerun": page.command(t["rerun"]), "setting": page.setting(i, b)}
                      for (i, b, dt), t in page.trace.items() if t["outcome"] == "failed"]
    serving_failures = [{"column": page.label(i, b), "dtype": dt, "outcome": e["outcome"], "message": e["message"],
                         "features": ", ".join(e["features"]) or "none of the features",
                         "failing": e["failing"], "rerun": page.command(e["rerun"]), "setting": page.setting(i, b)}
                        for (i, b, dt), e in page.serving.items() if e["outcome"] in ("failed", "errored")]
    failing_settings = []
    for f in failures + forward_failures + trace_failures + serving_failures:
        if f["setting"] and (f["column"], f["setting"]) not in failing_settings:
            failing_settings.append((f["column"], f["setting"]))
    relation_failures = [{"column": page.label(i, b), "dtype": dt, "relation": name, "outcome": r["outcome"],
                          "ops": ", ".join(r["ops"]), "message": r["message"], "rerun": page.command(r["rerun"])}
                         for (i, b, dt, name), r in page.relations.items() if status(r) == "fail"]
    return {"failures": failures, "forward_failures": forward_failures, "trace_failures": trace_failures,
            "serving_failures": serving_failures, "relation_failures": relation_failures,
            "failing_settings": failing_settings}


_EXCUSED_SUBJECTS = (("results", lambda e: e["op"]), ("relations", lambda e: e["relation"]),
                     ("forward", lambda e: "full forward"), ("serving", lambda e: "serving path"),
                     ("invariance", lambda e: f"{e['relation']} invariance (claimed)"))


def deviations_section(page: Page) -> dict:
    """The known deviations: the excused results, and the files' entries that matched nothing or no longer
    deviate."""
    excused = []
    for i, d in enumerate(page.documents):
        for key, subject in _EXCUSED_SUBJECTS:
            excused += [{"column": page.label(i, e["backend"]), "dtype": e["dtype"], "subject": subject(e),
                         "reason": e["deviation"],
                         "detail": (f"{shown(e['worst_ulps'])} ULPs against {shown(e['budget_ulps'])}"
                                    if key == "results" else e.get("message") or "; ".join(e.get("failures", [])))}
                        for e in d.get(key, []) if e["outcome"] == "known deviation"]
    stale = [{"label": page.doc_labels[i], **e} for i, d in enumerate(page.documents) for e in d["deviations"]
             if e["status"] != "excused"]
    return {"excused": excused, "stale": stale}


def conformance_section(page: Page) -> dict:
    """% conformant per column and dtype, and a line per backend that lacks something: the ops it does not
    implement, and the serving path without a session (the matrix shows each as a grey cell; this says it
    in words, once)."""
    conformance = []
    for c, (i, backend) in enumerate(page.columns):
        row, total_passed, total_tested, total_unsupported = [], 0, 0, 0
        for dtype in page.dtypes:
            rs = page.results(i, backend, dtype)
            tested = [r for r in rs if r["outcome"] != "unsupported"]
            passed = sum(status(r) in PASSED for r in tested)
            unsupported = len(rs) - len(tested)
            total_passed, total_tested, total_unsupported = (total_passed + passed, total_tested + len(tested),
                                                             total_unsupported + unsupported)
            unestablished = sum(status(r) == "unest" for r in tested)
            row.append({"percent": percent(passed, len(tested)), "passed": passed, "tested": len(tested),
                        "unsupported": unsupported,
                        "cls": "none" if not tested else ("ok" if passed == len(tested) else
                                                          "unest" if passed + unestablished == len(tested) else "fail")})
        conformance.append({"column": page.column_labels[c], "cells": row,
                            "total": {"percent": percent(total_passed, total_tested), "passed": total_passed,
                                      "tested": total_tested, "unsupported": total_unsupported,
                                      "cls": "none" if not total_tested else
                                      ("ok" if total_passed == total_tested else "fail")}})
    lacking = []
    for i, backend in dict.fromkeys([*page.columns, *((j, b) for j, b, _ in page.serving)]):
        unsupported = [r for r in page.documents[i]["results"] if r["backend"] == backend and r["outcome"] == "unsupported"]
        absent = {r["op"] for r in unsupported if not r["message"]}  # with a message: arguments the adapter refused
        names = [op for op in OP_NAMES if op in absent]
        missing = [f"{len(names)} op{'s' * (len(names) != 1)} not implemented: {', '.join(names)}"] if names else []
        missing += [f"{r['op']} in {r['dtype']} {r['message']}" for r in unsupported if r["message"]]
        if any(e["outcome"] == "unsupported" for (j, b, _), e in page.serving.items() if (j, b) == (i, backend)):
            missing.append("no session, so no serving path")
        if missing:
            lacking.append({"column": page.label(i, backend), "text": "; ".join(missing)})
    return {"conformance": conformance, "lacking": lacking}


def _result_cell(page: Page, i: int, backend: str, dtype: str, op: str) -> dict:
    """A cell of the matrix: the worst example's error over its budget, the headroom and the informative
    examples; its title all the statistics; a link to the failure's details."""
    r = page.cells.get((i, backend, dtype, op))
    cls = status(r)
    if r is None:
        return {"cls": cls, "text": "", "sub": "", "title": f"{backend} {dtype} {op}: not tested", "href": None}
    if r["worst_ulps"] is None:
        text = r["outcome"]
    else:
        text = f"{shown(r['worst_ulps'])} / {shown(r['budget_ulps'])}"
    sub = "" if r["headroom"] is None else f"{shown(r['headroom'])}x"
    if r["examples"]:
        sub += f" · {r['informative']}/{r['examples']} inf."
    title = (f"{backend} {dtype} {op}: {r['outcome']}, {examples(r['examples'])} of which {r['informative']} "
             f"informative (their allowance excluded zeros, the sign flipped and the like); worst example "
             f"{shown(r['worst_ulps'])} ULPs against a budget of {shown(r['budget_ulps'])} "
             f"({r['budget_formula']}), headroom {shown(r['headroom'])}; all examples: max "
             f"{shown(r['max_ulps'])}, p99 {shown(r['p99_ulps'])}, median {shown(r['median_ulps'])} ULPs")
    if r.get("given"):
        title += f"; {'conformant ' if r['outcome'] == 'passed' else ''}{r['given']}"
        sub += " · declared"
    if r["outcome"] == "unsupported" and r["message"]:
        title = f"{backend} {dtype} {op}: unsupported: {r['message']}"
    anchor = page.anchors.get((i, backend, dtype, op))
    return {"cls": cls, "text": text, "sub": sub, "title": title, "href": "#" + anchor if anchor else None}


def _forward_cell(f: dict, b: str, dtype: str) -> dict:
    c, base = number(f["logits"]["candidate"]), number(f["logits"]["baseline"])
    ratio = c / base if c is not None and base else None
    return {"cls": status(f), "text": f["outcome"],
            "sub": f"logits {shown(ratio)}x baseline" if ratio is not None else "",
            "title": f"{b} {dtype} forward: logits relative error {shown(c)} (baseline {shown(base)}), top-1 agreement "
                     f"{shown(f['top1_agreement'])}", "href": "#forward"}


def _trace_cell(t: dict, b: str, dtype: str) -> dict:
    first = t["first_departure"]
    return {"cls": status(t), "text": t["outcome"], "sub": f"first: {first['node']}" if first else "",
            "title": f"{b} {dtype} trace: {t['summary']}", "href": "#trace"}


def _serving_cell(e: dict, b: str, dtype: str) -> dict:
    w = e["worst"]
    return {"cls": status(e), "text": e["outcome"],
            "sub": f"worst row {shown(w['ratio'])} of allowed" if w else "",
            "title": f"{b} {dtype} serving path: {e['outcome']}; {e['tokens']} tokens of {e['sequences']} "
                     f"sequences in {e['schedules']} schedules", "href": "#serving"}


def _verdict_row(page: Page, entries: dict, cell) -> list[dict] | None:
    """A matrix row below the ops (forward, trace, serving): per dtype and column, ``cell(entry, backend,
    dtype)`` where the run has that entry, else an empty cell; None when no column has one."""
    empty = {"cls": "none", "text": "", "sub": "", "title": "", "href": None}
    row = [cell(e, b, dtype) if (e := entries.get((i, b, dtype))) is not None else empty
           for dtype in page.dtypes for i, b in page.columns]
    return row if any(c["text"] for c in row) else None


def matrix_section(page: Page) -> dict:
    """The conformance matrix: a row per op, a cell per dtype x column; rows for the forward, the trace
    and the serving path below."""
    return {"matrix": [{"op": op, "cells": [_result_cell(page, i, b, dtype, op) for dtype in page.dtypes
                                            for i, b in page.columns]} for op in page.ops],
            "forward_row": _verdict_row(page, page.forward, _forward_cell),
            "trace_row": _verdict_row(page, page.trace, _trace_cell),
            "serving_row": _verdict_row(page, page.serving, _serving_cell)}


def _relation_cell(page: Page, i: int, backend: str, dtype: str, name: str) -> dict:
    r = page.relations.get((i, backend, dtype, name))
    if r is None:
        return {"cls": "none", "text": "", "title": f"{backend} {dtype} {name}: not checked"}
    text = {"passed": "held", "failed": "violated"}.get(r["outcome"], r["outcome"])
    return {"cls": status(r), "text": text,
            "title": f"{backend} {dtype} {name} ({', '.join(r['ops'])}): {r['outcome']}, {examples(r['examples'])}"
                     + (f"; {r['message']}" if r["message"] else "")}


def theorems_section(page: Page) -> dict:
    """The spec's theorems, laid out like the matrix: held or violated."""
    return {"relation_matrix": [{"relation": name, "cells": [_relation_cell(page, i, b, dtype, name)
                                                             for dtype in page.dtypes for i, b in page.columns]}
                                for name in page.relation_names]}


def slack_section(page: Page) -> dict:
    """Per op and dtype, the budget over the largest error any backend that passed showed (marked when
    above SLACK_NOTE: a budget that loose may hide a fault)."""
    slack = []
    for op in page.ops:
        row = []
        for dtype in page.dtypes:
            passing = [(number(r["headroom"]), page.column_labels[c]) for c, (i, b) in enumerate(page.columns)
                       if (r := page.cells.get((i, b, dtype, op))) is not None and status(r) in PASSED
                       and number(r["headroom"]) is not None]
            tightest = min(passing, default=None)
            row.append({"text": shown(tightest[0]) + "x" if tightest else "",
                        "title": f"{op} {dtype}: the budget is {shown(tightest[0])} times the worst error of "
                                 f"{tightest[1]}, the tightest of {len(passing)} passing backend(s)" if tightest else "",
                        "cls": "warn" if tightest and tightest[0] > SLACK_NOTE else ""})
        slack.append({"op": op, "cells": row})
    return {"slack": slack if any(c["text"] for row in slack for c in row["cells"]) else None,
            "slack_note": shown(SLACK_NOTE)}


def closest_section(page: Page) -> dict:
    """The passing ops closest to their budget, per column, with their rerun commands (a correctly rounded
    one is left out: it is as close as a right answer can be, not close to failing)."""
    closest = []
    for c, (i, backend) in enumerate(page.columns):
        passing = [r for r in page.documents[i]["results"] if r["backend"] == backend and status(r) in ("ok", "warn")
                   and number(r["headroom"]) is not None and math.isfinite(number(r["headroom"]))]
        passing.sort(key=lambda r: number(r["headroom"]))
        for r in passing[:CLOSEST_PER_COLUMN]:
            closest.append({"column": page.column_labels[c], "dtype": r["dtype"], "op": r["op"], "cls": status(r),
                            "worst": shown(r["worst_ulps"]), "budget": shown(r["budget_ulps"]),
                            "headroom": shown(r["headroom"]), "max": shown(r["max_ulps"]), "examples": r["examples"],
                            "rerun": page.command(r["rerun"])})
    return {"closest": closest}


def histograms_section(page: Page) -> dict:
    """A chart per column and dtype: each op's examples' errors as fractions of their budgets."""
    histograms = []
    for c, (i, backend) in enumerate(page.columns):
        for dtype in page.dtypes:
            svg = histogram_chart(page.results(i, backend, dtype), page.chart_prefix("h"))
            if svg is not None:
                histograms.append({"column": page.column_labels[c], "dtype": dtype, "svg": svg})
    return {"histograms": histograms}


def own_errors(local: dict | None) -> str:
    """The worst layer's and the head's own error over the baseline's ("2.1 x, 1.2 x"), or "—"."""
    if not local:
        return "—"

    def ratio(c, b):
        c, b = number(c), number(b)
        return c / b if c is not None and b else math.inf

    layers = local["layers"]
    worst = max(ratio(c, b) for c, b in zip(layers["candidate"], layers["baseline"]))
    head = ratio(local["logits"]["candidate"], local["logits"]["baseline"])
    return f"{shown(worst)} ×, {shown(head)} ×"


def forward_section(page: Page) -> dict:
    """Per column and dtype, the full forward: its per-layer chart, the logits' and log-probabilities'
    errors against the baseline's, the layers' own errors and the top-1 agreement."""
    forwards = []
    for (i, b, dtype), f in _in_order(page.forward):
        top1 = number(f["top1_agreement"])
        forwards.append({"column": page.label(i, b), "dtype": dtype, "outcome": f["outcome"],
                         "svg": forward_chart(f, page.chart_prefix("f")), "layers": len(f["layers"]["candidate"]),
                         "logits": (shown(f["logits"]["candidate"]), shown(f["logits"]["baseline"])),
                         "gap": (shown(f["logprob_gap"]["candidate"]), shown(f["logprob_gap"]["baseline"])),
                         "own": own_errors(f.get("local")),
                         "top1": shown(100 * top1) + "%" if top1 is not None else "—",
                         "failures": f["failures"]})
    return {"forwards": forwards}


def trace_section(page: Page) -> dict:
    """Per column and dtype, the trace: its first departing node and a grid of layers x nodes."""
    return {"traces": [trace_view(page.label(i, b), dtype, t, page.command)
                       for (i, b, dtype), t in _in_order(page.trace)],
            "layer_nodes": list(LAYER_NODES)}


def serving_section(page: Page) -> dict:
    """Per column and dtype, the serving path: what was played, the worst row, the failing schedules' features."""
    servings = []
    for (i, b, dtype), e in _in_order(page.serving):
        w = e["worst"]
        servings.append({"column": page.label(i, b), "dtype": dtype, "outcome": e["outcome"],
                         "schedules": e["schedules"], "sequences": e["sequences"], "steps": e["steps"],
                         "tokens": e["tokens"],
                         "worst": None if w is None else {
                             "position": w["position"], "kind": "decode" if w["decode"] else "prefill chunk",
                             "error": shown(w["error"]), "baseline": shown(w["baseline"]), "ratio": shown(w["ratio"])},
                         "failing": e["failing"],
                         "failing_features": ", ".join(f"{name} ({n})" for name, n in e["failing_features"].items()
                                                       if n) or ("none" if e["failing"] else "")})
    return {"servings": servings}


INVARIANCE_CLASSES = {"held": "ok", "varies": "warn", "failed": "fail", "known deviation": "known", "errored": "broken",
                      "unsupported": "unsup", "not run": "notrun"}


def _ulps(difference: dict) -> str:
    """A difference at the row's scale and value by value, labelled (an older document has the second only)."""
    if difference.get("scaled") is None:
        return f"{shown(difference['ulps'])} ULPs"
    return f"{shown(difference['scaled'])} ULPs at the row's scale, {shown(difference['ulps'])} value by value"


def _invariance_cell(entry: dict | None) -> dict:
    """One relation of one backend and dtype: coloured by outcome (orange: not claimed and varies), its text
    the outcome and whether it was claimed, its title the worst difference."""
    if entry is None:
        return {"cls": "none", "text": "", "title": "not tested", "claimed": False}
    claim = "claimed" if entry["claimed"] else "not claimed"
    title = f"{entry['relation']}: {entry['outcome']} ({claim}); {entry['differing']} of {entry['rows']} rows " \
            f"differ in {entry['schedules']} schedule{'s' if entry['schedules'] != 1 else ''}"
    w = entry["worst"]
    if w is not None:
        title += f"; worst: sequence {w['sequence']} ({w['against']}) from position {w['position']}, " \
                 f"{w['rows']} rows, up to {_ulps(w)}"
    if entry.get("first_node"):
        title += f"; breaks first at {entry['first_node']}"
    text = entry["outcome"] + (f" · {shown(w.get('scaled', w['ulps']))} ULPs" if w is not None else "") + (
        f" · first at {entry['first_node']}" if entry.get("first_node") else "")
    return {"cls": INVARIANCE_CLASSES[entry["outcome"]], "text": text, "title": title, "claimed": entry["claimed"]}


def invariance_section(page: Page) -> dict:
    """Per column and dtype the three relations (claimed or measured, held or not, the worst difference)
    and the ops that are not batch-invariant; the claims that broke, with their rerun commands.
    Documents without the invariance keys contribute nothing."""
    relations: dict[tuple, dict] = {}
    ops: dict[tuple, list] = {}
    for i, d in enumerate(page.documents):
        for e in d.get("invariance", []):
            relations.setdefault((i, e["backend"], e["dtype"]), {})[e["relation"]] = e
        for e in d.get("op_invariance", []):
            ops.setdefault((i, e["backend"], e["dtype"]), []).append(e)
    rows, failures = [], []
    for key in sorted(set(relations) | set(ops), key=lambda k: (k[0], k[1], dtype_rank(k[2]))):
        i, backend, dtype = key
        entries = relations.get(key, {})
        checked = ops.get(key, [])
        varying = [f"{e['op']} ({_ulps(e)}; first at {e['where']})" for e in checked if e["differing"]]
        varying += [f"varies run to run: {e['op']} ({e['unrepeated']} of {e['repeated']} rows; first at "
                    f"{e['run_where']})" for e in checked if e.get("unrepeated")]
        rows.append({"column": page.label(i, backend), "dtype": dtype,
                     "cells": [_invariance_cell(entries.get(r)) for r in INVARIANCE],
                     "ops": "; ".join(varying) or ("none" if checked else "—"), "checked": len(checked)})
        failures += [{"column": page.label(i, backend), "dtype": dtype, "relation": r, "message": e["message"],
                      "rerun": page.command(e["rerun"])} for r, e in entries.items() if e["outcome"] == "failed"]
    blocked = [name for name in OP_NAMES if OPS[name].blocks]
    return {"invariance": rows, "invariance_relations": list(INVARIANCE), "invariance_failures": failures,
            "blocked_ops": f"{', '.join(blocked[:-1])} and {blocked[-1]}",
            "blocks": " and ".join(map(str, sorted({m for name in blocked for m in OPS[name].blocks})))}


TRACE_CLASSES = {"passed": "ok", "failed": "fail", "not traced": "notrun", "inputs not traced": "unsup"}


def _node_cell(node: dict | None) -> dict:
    """A cell of the trace grid: coloured by outcome (teal: correctly rounded, within a budget of one
    rounding; orange: passed with headroom under WARN_HEADROOM), its text the error as a fraction of the budget."""
    if node is None:
        return {"cls": "none", "text": "", "title": "no such node on this layer"}
    error, budget = number(node["error"]), number(node["budget"])
    ratio = error / budget if error is not None and budget else None
    cls = TRACE_CLASSES[node["outcome"]]
    if cls == "ok" and budget is not None and 0 < budget < ONE_ROUNDING:
        cls = "cr"
    elif cls == "ok" and ratio is not None and ratio * WARN_HEADROOM > 1:
        cls = "warn"
    title = f"{node['node']} ({node['op']}): {node['outcome']}"
    if ratio is not None:
        title += f", {shown(error)} ULPs against a budget of {shown(budget)}"
    if node.get("given"):  # optional in the schema: documents written before it lack it
        title += f" {node['given']}"
    if node["outcome"] == "passed" and not node["informative"]:
        title += " (not informative: its budget admits a trivially wrong answer here)"
    if node["message"]:
        title += f"; {node['message']}"
    text = shown(ratio) if ratio is not None else {"not traced": "—", "inputs not traced": "·"}.get(node["outcome"], "")
    return {"cls": cls, "text": text, "title": title}


def trace_view(column: str, dtype: str, entry: dict, command) -> dict:
    """One trace for the page: the first departing node, and a row per layer of node cells and counts."""
    by_node = {n["node"]: n for n in entry["nodes"]}
    rows = []
    for row in entry["layers"]:
        where = row["where"]
        if where.startswith("layer "):
            prefix = f"layers.{where.split()[1]}."
            cells = [_node_cell(by_node.get(prefix + name)) for name in LAYER_NODES]
        else:  # embed, or final: their nodes in the first columns
            own = [n for n in entry["nodes"] if not n["node"].startswith("layers.")
                   and (n["node"] == "embed") == (where == "embed")]
            cells = [{**_node_cell(n), "text": n["node"]} for n in own]
            cells += [_node_cell(None)] * (len(LAYER_NODES) - len(cells))
        rows.append({"where": where, "cells": cells, "counts": row})
    first = entry["first_departure"]
    return {"column": column, "dtype": dtype, "outcome": entry["outcome"], "summary": entry["summary"],
            "first": first and {**first, "error": shown(first["error"]), "budget": shown(first["budget"])},
            "rerun": command(entry["rerun"]), "rows": rows, "work": entry["work"],
            "open": entry["outcome"] == "failed"}


def _environment_rows(env: dict) -> list[tuple[str, str]]:
    """A document's environment, a (key, value as text) row per key; its backends are _backend_rows'."""
    rows = []
    for key, value in env.items():
        if key == "backends":  # shown per backend (_backend_rows)
            continue
        if key == "libraries" and isinstance(value, dict):
            value = ", ".join(f"{name} {version}" for name, version in value.items()) or "none found"
        elif key == "accelerators" and isinstance(value, list):
            value = ", ".join(map(str, value)) or "none seen"
        elif not isinstance(value, str):
            value = json.dumps(value)
        rows.append((key.replace("_", " "), value))
    return rows


def _backend_rows(env: dict) -> list[dict]:
    """Per backend of a document: where it ran and its math modes, one row each."""
    tables = []
    for backend, described in (env.get("backends") or {}).items():
        if not isinstance(described, dict):
            continue
        rows = []
        for key, value in described.items():
            if key == "math_modes" and isinstance(value, dict):
                rows.extend((f"math: {mode}", json.dumps(setting) if not isinstance(setting, str) else setting)
                            for mode, setting in value.items())
            else:
                rows.append((key.replace("_", " "), value if isinstance(value, str) else json.dumps(value)))
        tables.append({"backend": backend, "rows": rows})
    return tables


def environment_section(page: Page) -> dict:
    """Each document's environment, and each of its backends' device and math modes."""
    return {"documents": [{"label": page.doc_labels[i], "rows": _environment_rows(d["environment"]),
                           "backend_tables": _backend_rows(d["environment"]),
                           "backends": sorted({r["backend"] for r in d["results"] + d["forward"] + d["traces"]})}
                          for i, d in enumerate(page.documents)]}


# The sections in the page's order, which is also the order of the command and chart numbers.
SECTIONS = (broken_section, failures_section, deviations_section, conformance_section, matrix_section,
            theorems_section, slack_section, closest_section, histograms_section, forward_section, trace_section,
            serving_section, invariance_section, environment_section)


def context(documents: list[dict], labels=None, title: str | None = None) -> dict:
    """Everything the template shows, computed from the documents (validated first)."""
    for i, d in enumerate(documents):
        validate(d, f"document {i + 1}")
    page = Page(documents, labels)
    shown_sections = {}
    for section in SECTIONS:
        shown_sections.update(section(page))
    return {
        "title": title or "Gemma 4 conformance report",
        "multiple": len(documents) > 1,
        "columns": page.column_labels,
        "dtypes": page.dtypes,
        "ops": page.ops,
        "n_results": sum(len(d["results"]) for d in documents),
        "warn_headroom": shown(WARN_HEADROOM),
        "colours": COLOURS,
        **shown_sections,
    }


@cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.html.j2")


def render(documents: list[dict], labels: list[str] | None = None, title: str | None = None) -> str:
    """One self-contained HTML page showing ``documents`` (report documents) side by side.

    ``labels`` name the documents (default: each environment's ``label``, else "report N"); they
    tell apart a backend that occurs in several documents.
    """
    return _template().render(**context(list(documents), labels, title))


def write(path, documents: list[dict], labels: list[str] | None = None, title: str | None = None) -> Path:
    """Render ``documents`` to the HTML file ``path`` (its folder is created); returns the path."""
    path = Path(path)
    page = render(documents, labels, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
