"""The HTML page: one or several report documents on one self-contained page.

``render(documents)`` returns the page as a string; ``write(path, documents)`` writes it.  The markup
comes from ``templates/report.html.j2`` with autoescaping on; the only unescaped strings are the SVGs
matplotlib draws.  What the page shows, section by section: docs/report.md.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import re
from functools import cache
from pathlib import Path

import jinja2
import matplotlib
import numpy as np
from markupsafe import Markup
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gemma4_conformance.spec import OP_NAMES
from gemma4_conformance.adapters import INVARIANCE
from gemma4_conformance.spec.model import LAYER_NODES

from .data import dtype_rank, number, validate

TEMPLATES = Path(__file__).with_name("templates")
WARN_HEADROOM = 1.5  # a passing op with less headroom than this is shown orange
# A budget below this allows the final rounding (0.5 ULP) and terms of formats wider than the dtype, and
# no second rounding in it (which would take it to 1): a result within it is correctly rounded, not a
# near failure, however little headroom 0.5 / 0.5 leaves.
ONE_ROUNDING = 0.75
CLOSEST_PER_COLUMN = 10  # passing ops listed per backend in "closest to budget"
SLACK_NOTE = 100  # a budget this many times the largest error any passing backend showed is marked
COLOURS = {"fail": "#e03131", "known": "#9c36b5", "cr": "#0ca678", "warn": "#f08c00", "ok": "#2f9e44",
           "unest": "#1c7ed6", "unsup": "#adb5bd", "notrun": "#868e96", "none": "#dee2e6"}
_RC = {
    "svg.fonttype": "none",  # text stays text: small, searchable, no embedded glyph paths
    "svg.hashsalt": "gemma4-conformance",  # deterministic ids
    "font.family": "sans-serif", "font.sans-serif": ["DejaVu Sans"], "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8,
    "xtick.labelsize": 7, "ytick.labelsize": 7, "legend.fontsize": 7,
    "axes.spines.top": False, "axes.spines.right": False, "axes.linewidth": 0.6,
}


# ----------------------------------------------------------------------------------------- formatting

def shown(value) -> str:
    """A number for a reader: 3 significant digits, "∞", "—" for not measured."""
    x = number(value)
    if x is None:
        return "—"
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e3:
        return f"{x:.3g}"
    if 1e3 <= abs(x) < 1e6:
        return f"{x:.0f}"
    return f"{x:.2e}"


def percent(passed: int, tested: int) -> str:
    if not tested:
        return "—"
    p = 100 * passed / tested
    return f"{math.floor(p) if passed < tested else 100:.0f}%"


def status(result: dict | None) -> str:
    """The cell's colour class: fail, known (an excused failure), cr (correctly rounded: passed a budget of
    one rounding), warn (headroom < 1.5), ok, unest (not
    established: too few informative examples), unsup, notrun, none (not tested). Theorems (no
    headroom) are ok, known, fail, unsup or notrun."""
    if result is None:
        return "none"
    outcome, headroom = result["outcome"], number(result.get("headroom"))
    if outcome == "unsupported":
        return "unsup"
    if outcome == "not established":
        return "unest"
    if outcome == "known deviation":
        return "known"
    if outcome in ("failed", "errored") or (headroom is not None and headroom < 1):
        return "fail"
    if outcome == "not run":
        return "notrun"
    budget_ulps = number(result.get("budget_ulps"))
    if budget_ulps is not None and 0 < budget_ulps < ONE_ROUNDING:
        return "cr"
    if headroom is not None and headroom < WARN_HEADROOM:
        return "warn"
    return "ok"


PASSED = ("ok", "warn", "cr")


def examples(n: int) -> str:
    return f"{n} example" if n == 1 else f"{n} examples"


def over(result: dict) -> float | None:
    """How many times its budget the worst example's error is (the reciprocal of the headroom)."""
    m, b = number(result["worst_ulps"]), number(result["budget_ulps"])
    return m / b if m is not None and b else None


# ----------------------------------------------------------------------------------------- charts

_SVG_START = re.compile(r"^.*?(?=<svg\b)", re.DOTALL)
_DROP = re.compile(r"<metadata>.*?</metadata>|<!--.*?-->|\s+xmlns(?::\w+)?=\"[^\"]*\"", re.DOTALL)
_IDS = re.compile(r"(\bid=\"|url\(#|href=\"#)([^\")]+)")


_PATH_DATA = re.compile(r'\bd="([^"]*)"')
_DECIMALS = re.compile(r"(\.\d)\d+")
_NUMBER_ATTR = re.compile(r'\b([xy])="(-?\d+\.\d)\d*"')
_NO_ROTATION = re.compile(r' transform="rotate\(-?0 [^"]*\)"')


def _svg(fig: Figure, prefix: str) -> Markup:
    """The figure as inline SVG: no XML prologue, namespaces or metadata, ids made unique to the page,
    path coordinates to 0.1 pt and indentation dropped (a third of the size)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = _DROP.sub("", _SVG_START.sub("", buf.getvalue(), count=1))
    svg = _IDS.sub(lambda m: f"{m.group(1)}{prefix}{m.group(2)}", svg)
    svg = _PATH_DATA.sub(lambda m: 'd="' + _DECIMALS.sub(r"\1", " ".join(m.group(1).split())) + '"', svg)
    svg = _NUMBER_ATTR.sub(r'\1="\2"', _NO_ROTATION.sub("", svg))
    return Markup(re.sub(r">\s+<", "><", svg.strip()))


def _figure(width: float, height: float, layout: str | None = "constrained") -> Figure:
    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def histogram_chart(results: list[dict], prefix: str) -> Markup | None:
    """Small multiples: one panel per op, its examples' largest errors as fractions of their budgets
    (a budget depends on the example's dimensions), the budget dashed at 1."""
    panels = [r for r in results if r["histogram"]]
    if not panels:
        return None
    ncols = min(5, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    row, width = 1.2, 1.75  # inches per panel
    with matplotlib.rc_context(_RC):
        # Fixed margins rather than a layout engine: several times faster on 25 panels.
        fig = _figure(width * ncols, row * nrows + 0.2, layout=None)
        height = row * nrows + 0.2
        axes = fig.subplots(nrows, ncols, squeeze=False, gridspec_kw={
            "left": 0.1 / (width * ncols), "right": 1 - 0.15 / (width * ncols), "top": 1 - 0.2 / height,
            "bottom": 0.38 / height, "hspace": 0.75, "wspace": 0.08}).ravel()
        for ax, r in zip(axes, panels):
            values = [v for v in map(number, r["histogram"]) if v is not None and math.isfinite(v)]
            top = max([*values, 1.0]) * 1.08
            counts, edges = np.histogram(values, bins=24, range=(0, top))
            ax.stairs(counts, edges, fill=True, color=COLOURS[status(r)], alpha=0.85)
            ax.axvline(1.0, color="#495057", lw=0.8, ls="--")
            ax.set_title(f"{r['op']}  ({shown(r['worst_ulps'])} / {shown(r['budget_ulps'])})", loc="left",
                         parse_math=False)  # a name from a document is plain text, never mathtext
            ax.set_yticks([])
            ax.set_xlim(0, top)
            ax.xaxis.set_major_locator(MaxNLocator(4, steps=[1, 2, 2.5, 5, 10]))  # 0, 0.5, 1: the budget a tick
            ax.tick_params(length=2, pad=1)
        for ax in axes[len(panels):]:
            ax.set_axis_off()
        for ax in axes[(nrows - 1) * ncols:]:
            ax.set_xlabel("error / budget")
        return _svg(fig, prefix)


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


def forward_chart(entry: dict, prefix: str) -> Markup | None:
    """Per-layer relative error against the certified reference, candidate vs baseline, log scale."""
    def positive(values):
        out = [number(v) for v in values]
        return [v if v is not None and v > 0 and math.isfinite(v) else math.nan for v in out]

    candidate, baseline = positive(entry["layers"]["candidate"]), positive(entry["layers"]["baseline"])
    if all(math.isnan(v) for v in candidate + baseline):  # no positive finite value: nothing to draw on a log axis
        return None
    factor, floor = number(entry.get("accumulated_factor", entry["factor"])), number(entry["floor"])
    layers = list(range(len(candidate)))
    with matplotlib.rc_context(_RC):
        fig = _figure(4.2, 2.3)
        ax = fig.subplots()
        if factor is not None:
            allowed = [max(factor * b, floor or 0) if not math.isnan(b) else math.nan for b in baseline]
            ax.plot(layers, allowed, color="#adb5bd", lw=0.8, ls=":", label=f"allowed ({shown(factor)}x baseline)")
        ax.plot(layers, baseline, color="#495057", lw=1.0, ls="--", label="baseline (plain, same dtype)")
        ax.plot(layers, candidate, color=COLOURS[status(entry)], lw=1.3,
                label="candidate")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("relative error vs reference")
        ax.legend(loc="best", frameon=False)
        ax.tick_params(length=2, pad=1)
        return _svg(fig, prefix)


# ----------------------------------------------------------------------------------------- the page

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


def _environment_rows(env: dict) -> list[tuple[str, str]]:
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


def setting(env: dict, backend: str) -> str:
    """Where ``backend`` ran and the math modes that decide its verdicts, in a line ("" when unknown)."""
    described = (env.get("backends") or {}).get(backend)
    if not isinstance(described, dict):
        return ""
    device, name = str(described.get("device", "")), described.get("device_name")
    where = device + (f" ({name})" if name and name not in (device, "cpu") else "")
    return "; ".join(part for part in (where, described.get("math_summary", "")) if part)


def context(documents: list[dict], labels=None, title: str | None = None) -> dict:
    """Everything the template shows, computed from the documents (validated first)."""
    for i, d in enumerate(documents):
        validate(d, f"document {i + 1}")
    doc_labels = _labels(documents, labels)

    # Columns: (document, backend) pairs in order of appearance; a backend seen in several documents
    # carries the document's label.
    seen_in: dict[str, set[int]] = {}
    for i, d in enumerate(documents):
        for entry in d["results"] + d["forward"] + d["traces"] + d["serving"]:
            seen_in.setdefault(entry["backend"], set()).add(i)

    def label(i: int, backend: str) -> str:
        return f"{backend} · {doc_labels[i]}" if len(seen_in.get(backend, ())) > 1 else backend

    columns, ops, dtypes, cells = [], [], set(), {}
    for i, d in enumerate(documents):
        for r in d["results"]:
            key = (i, r["backend"])
            if key not in columns:
                columns.append(key)
            if r["op"] not in ops:
                ops.append(r["op"])
            dtypes.add(r["dtype"])
            cells[i, r["backend"], r["dtype"], r["op"]] = r
    forward = {(i, f["backend"], f["dtype"]): f for i, d in enumerate(documents) for f in d["forward"]}
    trace = {(i, t["backend"], t["dtype"]): t for i, d in enumerate(documents) for t in d["traces"]}
    dtypes = sorted(dtypes | {dt for _, _, dt in forward} | {dt for _, _, dt in trace}
                    | {r["dtype"] for d in documents for r in d["relations"]}, key=dtype_rank)
    column_labels = [label(i, b) for i, b in columns]
    counter = itertools.count(1)

    def command(text: str) -> dict | None:
        return {"id": f"cmd-{next(counter)}", "text": text} if text else None

    # Failures, worst first within a backend and dtype.
    failures, anchors = [], {}
    for c, (i, backend) in enumerate(columns):
        for dtype in dtypes:
            failing = [r for op in ops if (r := cells.get((i, backend, dtype, op))) is not None and status(r) == "fail"]
            failing.sort(key=lambda r: (r["outcome"] != "errored", -(over(r) or 0.0)))  # errored, then worst
            for r in failing:
                anchor = f"fail-{len(failures) + 1}"
                anchors[i, backend, dtype, r["op"]] = anchor
                failures.append({"anchor": anchor, "column": column_labels[c], "dtype": dtype, "op": r["op"],
                                 "outcome": r["outcome"], "worst": shown(r["worst_ulps"]),
                                 "budget": shown(r["budget_ulps"]),
                                 "over": shown(over(r)) if over(r) is not None else None,
                                 "examples": examples(r["examples"]), "formula": r["budget_formula"],
                                 "message": r["message"], "rerun": command(r["rerun"]),
                                 "setting": setting(documents[i]["environment"], backend)})
    forward_failures = [{"column": label(i, b), "dtype": dt, "failures": f["failures"], "rerun": command(f["rerun"]),
                         "setting": setting(documents[i]["environment"], b)}
                        for (i, b, dt), f in forward.items() if f["outcome"] == "failed"]
    trace_failures = [{"column": label(i, b), "dtype": dt, "summary": t["summary"], "failures": t["failures"],
                       "rerun": command(t["rerun"]),
                       "setting": setting(documents[i]["environment"], b)}
                      for (i, b, dt), t in trace.items() if t["outcome"] == "failed"]
    serving = {(i, e["backend"], e["dtype"]): e for i, d in enumerate(documents) for e in d["serving"]}
    serving_failures = [{"column": label(i, b), "dtype": dt, "outcome": e["outcome"], "message": e["message"],
                         "features": ", ".join(e["features"]) or "none of the features",
                         "failing": e["failing"], "rerun": command(e["rerun"]),
                         "setting": setting(documents[i]["environment"], b)}
                        for (i, b, dt), e in serving.items() if e["outcome"] in ("failed", "errored")]
    failing_settings = []  # each failing backend's device and math modes, once, above the failures
    for f in failures + forward_failures + trace_failures + serving_failures:
        if f["setting"] and (f["column"], f["setting"]) not in failing_settings:
            failing_settings.append((f["column"], f["setting"]))

    # The spec's theorems: failures, and a matrix like the ops'.
    relations, relation_names = {}, []
    for i, d in enumerate(documents):
        for r in d["relations"]:
            relations[i, r["backend"], r["dtype"], r["relation"]] = r
            if r["relation"] not in relation_names:
                relation_names.append(r["relation"])
            if (i, r["backend"]) not in columns:
                columns.append((i, r["backend"]))
                column_labels.append(label(i, r["backend"]))
    for i, backend, _ in [*forward, *trace]:  # an engine with a forward and no ops still gets its column
        if (i, backend) not in columns:
            columns.append((i, backend))
            column_labels.append(label(i, backend))
    relation_failures = [{"column": label(i, b), "dtype": dt, "relation": name, "outcome": r["outcome"],
                          "ops": ", ".join(r["ops"]), "message": r["message"], "rerun": command(r["rerun"])}
                         for (i, b, dt, name), r in relations.items() if status(r) == "fail"]

    def relation_cell(i, backend, dtype, name):
        r = relations.get((i, backend, dtype, name))
        if r is None:
            return {"cls": "none", "text": "", "title": f"{backend} {dtype} {name}: not checked"}
        text = {"passed": "held", "failed": "violated"}.get(r["outcome"], r["outcome"])
        return {"cls": status(r), "text": text,
                "title": f"{backend} {dtype} {name} ({', '.join(r['ops'])}): {r['outcome']}, {examples(r['examples'])}"
                         + (f"; {r['message']}" if r["message"] else "")}

    relation_matrix = [{"relation": name, "cells": [relation_cell(i, b, dtype, name) for dtype in dtypes
                                                     for i, b in columns]} for name in relation_names]

    # What broke, and the known deviations (excused results, and the files' stale or unmatched entries).
    problems = [{"label": doc_labels[i], **p} for i, d in enumerate(documents) for p in d["problems"]]
    excused = [{"column": label(i, e["backend"]), "dtype": e["dtype"],
                "subject": e.get("op") or e.get("relation") or ("serving path" if "schedules" in e else "full forward"),
                "reason": e["deviation"],
                "detail": (f"{shown(e['worst_ulps'])} ULPs against {shown(e['budget_ulps'])}" if "worst_ulps" in e
                           else e.get("message") or "; ".join(e.get("failures", [])))}
               for i, d in enumerate(documents) for e in d["results"] + d["relations"] + d["forward"] + d["serving"]
               if e["outcome"] == "known deviation"]
    stale = [{"label": doc_labels[i], **e} for i, d in enumerate(documents) for e in d["deviations"]
             if e["status"] != "excused"]

    # One line per backend that lacks something: the ops it does not implement, and the serving path
    # without a session (the matrix shows each as a grey cell; this says it in words, once).
    lacking = []
    for i, backend in dict.fromkeys([*columns, *((j, b) for j, b, _ in serving)]):
        absent = {r["op"] for r in documents[i]["results"] if r["backend"] == backend and r["outcome"] == "unsupported"}
        names = [op for op in OP_NAMES if op in absent]
        missing = [f"{len(names)} op{'s' * (len(names) != 1)} not implemented: {', '.join(names)}"] if names else []
        if any(e["outcome"] == "unsupported" for (j, b, _), e in serving.items() if (j, b) == (i, backend)):
            missing.append("no session, so no serving path")
        if missing:
            lacking.append({"column": label(i, backend), "text": "; ".join(missing)})

    # % conformant per column and dtype.
    conformance = []
    for c, (i, backend) in enumerate(columns):
        row, total_passed, total_tested, total_unsupported = [], 0, 0, 0
        for dtype in dtypes:
            rs = [r for op in ops if (r := cells.get((i, backend, dtype, op))) is not None]
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
        conformance.append({"column": column_labels[c], "cells": row,
                            "total": {"percent": percent(total_passed, total_tested), "passed": total_passed,
                                      "tested": total_tested, "unsupported": total_unsupported,
                                      "cls": "none" if not total_tested else
                                      ("ok" if total_passed == total_tested else "fail")}})

    # The matrix: a row per op, a cell per dtype x column.
    def cell(i, backend, dtype, op):
        r = cells.get((i, backend, dtype, op))
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
        return {"cls": cls, "text": text, "sub": sub, "title": title,
                "href": "#" + anchors[i, backend, dtype, op] if (i, backend, dtype, op) in anchors else None}

    matrix = [{"op": op, "cells": [cell(i, b, dtype, op) for dtype in dtypes for i, b in columns]} for op in ops]
    def verdict_row(entries: dict, cell) -> list[dict]:
        """A matrix row below the ops (forward, trace, serving): per dtype and column, ``cell(entry, backend,
        dtype)`` where the run has that entry, else an empty cell."""
        empty = {"cls": "none", "text": "", "sub": "", "title": "", "href": None}
        return [cell(e, b, dtype) if (e := entries.get((i, b, dtype))) is not None else empty
                for dtype in dtypes for i, b in columns]

    def forward_cell(f, b, dtype):
        c, base = number(f["logits"]["candidate"]), number(f["logits"]["baseline"])
        ratio = c / base if c is not None and base else None
        return {"cls": status(f), "text": f["outcome"],
                "sub": f"logits {shown(ratio)}x baseline" if ratio is not None else "",
                "title": f"{b} {dtype} forward: logits relative error {shown(c)} (baseline {shown(base)}), top-1 agreement "
                         f"{shown(f['top1_agreement'])}", "href": "#forward"}

    def trace_cell(t, b, dtype):
        first = t["first_departure"]
        return {"cls": status(t), "text": t["outcome"], "sub": f"first: {first['node']}" if first else "",
                "title": f"{b} {dtype} trace: {t['summary']}", "href": "#trace"}

    def serving_cell(e, b, dtype):
        w = e["worst"]
        return {"cls": status(e), "text": e["outcome"],
                "sub": f"worst row {shown(w['ratio'])} of allowed" if w else "",
                "title": f"{b} {dtype} serving path: {e['outcome']}; {e['tokens']} tokens of {e['sequences']} "
                         f"sequences in {e['schedules']} schedules", "href": "#serving"}

    forward_row = verdict_row(forward, forward_cell)

    # Budget slack: per op and dtype, the budget over the largest error any backend that passed showed.
    slack = []
    for op in ops:
        row = []
        for dtype in dtypes:
            passing = [(number(r["headroom"]), column_labels[c]) for c, (i, b) in enumerate(columns)
                       if (r := cells.get((i, b, dtype, op))) is not None and status(r) in PASSED
                       and number(r["headroom"]) is not None]
            tightest = min(passing, default=None)
            row.append({"text": shown(tightest[0]) + "x" if tightest else "",
                        "title": f"{op} {dtype}: the budget is {shown(tightest[0])} times the worst error of "
                                 f"{tightest[1]}, the tightest of {len(passing)} passing backend(s)" if tightest else "",
                        "cls": "warn" if tightest and tightest[0] > SLACK_NOTE else ""})
        slack.append({"op": op, "cells": row})

    trace_row, serving_row = verdict_row(trace, trace_cell), verdict_row(serving, serving_cell)
    servings = []
    for (i, b, dtype), e in sorted(serving.items(), key=lambda kv: (kv[0][0], kv[0][1], dtype_rank(kv[0][2]))):
        w = e["worst"]
        servings.append({"column": label(i, b), "dtype": dtype, "outcome": e["outcome"],
                         "schedules": e["schedules"], "sequences": e["sequences"], "steps": e["steps"],
                         "tokens": e["tokens"],
                         "worst": None if w is None else {
                             "position": w["position"], "kind": "decode" if w["decode"] else "prefill chunk",
                             "error": shown(w["error"]), "baseline": shown(w["baseline"]), "ratio": shown(w["ratio"])},
                         "failing": e["failing"],
                         "failing_features": ", ".join(f"{name} ({n})" for name, n in e["failing_features"].items()
                                                       if n) or ("none" if e["failing"] else "")})

    # Passing ops closest to their budget, per column (a correctly rounded one is as close as a right
    # answer can be, not close to failing).
    closest = []
    for c, (i, backend) in enumerate(columns):
        passing = [r for r in documents[i]["results"] if r["backend"] == backend and status(r) in ("ok", "warn")
                   and number(r["headroom"]) is not None and math.isfinite(number(r["headroom"]))]
        passing.sort(key=lambda r: number(r["headroom"]))
        for r in passing[:CLOSEST_PER_COLUMN]:
            closest.append({"column": column_labels[c], "dtype": r["dtype"], "op": r["op"], "cls": status(r),
                            "worst": shown(r["worst_ulps"]), "budget": shown(r["budget_ulps"]),
                            "headroom": shown(r["headroom"]), "max": shown(r["max_ulps"]), "examples": r["examples"],
                            "rerun": command(r["rerun"])})

    # Charts.
    charts = itertools.count(1)
    histograms = []
    for c, (i, backend) in enumerate(columns):
        for dtype in dtypes:
            rs = [r for op in ops if (r := cells.get((i, backend, dtype, op))) is not None]
            svg = histogram_chart(rs, f"h{next(charts)}-")
            if svg is not None:
                histograms.append({"column": column_labels[c], "dtype": dtype, "svg": svg})
    forwards = []
    for (i, b, dtype), f in sorted(forward.items(), key=lambda kv: (kv[0][0], kv[0][1], dtype_rank(kv[0][2]))):
        forwards.append({"column": label(i, b), "dtype": dtype, "outcome": f["outcome"],
                         "svg": forward_chart(f, f"f{next(charts)}-"), "layers": len(f["layers"]["candidate"]),
                         "logits": (shown(f["logits"]["candidate"]), shown(f["logits"]["baseline"])),
                         "gap": (shown(f["logprob_gap"]["candidate"]), shown(f["logprob_gap"]["baseline"])),
                         "own": own_errors(f.get("local")),
                         "top1": shown(100 * number(f["top1_agreement"])) + "%"
                         if number(f["top1_agreement"]) is not None else "—",
                         "failures": f["failures"]})

    traces = [trace_view(label(i, b), dtype, t, command)
              for (i, b, dtype), t in sorted(trace.items(), key=lambda kv: (kv[0][0], kv[0][1], dtype_rank(kv[0][2])))]

    environments = [{"label": doc_labels[i], "rows": _environment_rows(d["environment"]),
                     "backend_tables": _backend_rows(d["environment"]),
                     "backends": sorted({r["backend"] for r in d["results"] + d["forward"] + d["traces"]})}
                    for i, d in enumerate(documents)]
    n_results = sum(len(d["results"]) for d in documents)
    return {
        "title": title or "Gemma 4 conformance report",
        "documents": environments,
        "multiple": len(documents) > 1,
        "columns": column_labels,
        "dtypes": dtypes,
        "ops": ops,
        "failures": failures,
        "forward_failures": forward_failures,
        "failing_settings": failing_settings,
        "trace_failures": trace_failures,
        "relation_failures": relation_failures,
        "relation_matrix": relation_matrix,
        "problems": problems,
        "excused": excused,
        "stale": stale,
        "conformance": conformance,
        "lacking": lacking,
        "matrix": matrix,
        "forward_row": forward_row if forward_row and any(c["text"] for c in forward_row) else None,
        "trace_row": trace_row if any(c["text"] for c in trace_row) else None,
        "traces": traces,
        "layer_nodes": list(LAYER_NODES),
        "serving_row": serving_row if any(c["text"] for c in serving_row) else None,
        "servings": servings,
        "serving_failures": serving_failures,
        "closest": closest,
        "slack": slack if any(c["text"] for row in slack for c in row["cells"]) else None,
        "slack_note": shown(SLACK_NOTE),
        "histograms": histograms,
        "forwards": forwards,
        "n_results": n_results,
        "warn_headroom": shown(WARN_HEADROOM),
        "colours": COLOURS,
        **invariance_context(documents, label, command),
    }


INVARIANCE_CLASSES = {"held": "ok", "varies": "warn", "failed": "fail", "errored": "broken", "unsupported": "unsup",
                      "not run": "notrun"}


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
                 f"{w['rows']} rows, up to {shown(w['ulps'])} ULPs"
    text = entry["outcome"] + (f" · {shown(w['ulps'])} ULPs" if w is not None else "")
    return {"cls": INVARIANCE_CLASSES[entry["outcome"]], "text": text, "title": title, "claimed": entry["claimed"]}


def invariance_context(documents: list[dict], label, command) -> dict:
    """The invariance section: per column and dtype the three relations (claimed or measured, held or
    not, the worst difference) and the ops that are not batch-invariant; the claims that broke, with
    their rerun commands.  Documents without the invariance keys contribute nothing."""
    relations: dict[tuple, dict] = {}
    ops: dict[tuple, list] = {}
    for i, d in enumerate(documents):
        for e in d.get("invariance", []):
            relations.setdefault((i, e["backend"], e["dtype"]), {})[e["relation"]] = e
        for e in d.get("op_invariance", []):
            ops.setdefault((i, e["backend"], e["dtype"]), []).append(e)
    rows, failures = [], []
    for key in sorted(set(relations) | set(ops), key=lambda k: (k[0], k[1], dtype_rank(k[2]))):
        i, backend, dtype = key
        entries = relations.get(key, {})
        checked = ops.get(key, [])
        varying = [f"{e['op']} ({shown(e['ulps'])} ULPs; first at {e['where']})" for e in checked if e["differing"]]
        rows.append({"column": label(i, backend), "dtype": dtype,
                     "cells": [_invariance_cell(entries.get(r)) for r in INVARIANCE],
                     "ops": "; ".join(varying) or ("none" if checked else "—"), "checked": len(checked)})
        failures += [{"column": label(i, backend), "dtype": dtype, "relation": r, "message": e["message"],
                      "rerun": command(e["rerun"])} for r, e in entries.items() if e["outcome"] == "failed"]
    return {"invariance": rows, "invariance_relations": list(INVARIANCE), "invariance_failures": failures}


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
