"""The report document: one conformance run as a plain, JSON-able, versioned dict.

``document(recorder, environment())`` builds it from the pytest plugin's ``Recorder``; ``dump`` writes it
as JSON and ``load`` reads one back, checking its schema.  The HTML page (``report.html``) is rendered
from documents only, so reports written on other machines, by other backends or by other versions of
the suite can be merged into one page.

Schema ``gemma4-conformance-report``, version 5
==============================================

Top level (an object)::

    schema       "gemma4-conformance-report"
    version      5 (an integer; a reader refuses versions it does not know).  Version 2 added
                 ``worst_ulps`` and ``forward[i].rerun``, made ``max_ulps`` the largest error of any
                 example (in version 1 it was the worst example's) and the histogram a fraction of
                 each example's budget.  Version 3 added ``results[i].informative``, the outcome
                 "not established", and the second tier of attention's budgets.  Version 4 added
                 ``traces``, version 5 ``serving`` and ``forward[i].local``.
    environment  object: where and with what the run happened (below)
    results      array: one entry per backend x dtype x op that the run recorded (below)
    relations    array: one entry per backend x dtype x theorem of the spec checked (below)
    forward      array: one entry per backend x dtype whose full forward ran (below)
    traces       array: one entry per backend x dtype whose forward's trace was judged node by node
                 (below)
    serving      array: one entry per backend x dtype whose serving path was tested, or found
                 unsupported (below)
    invariance   array (optional: absent from documents of suites before it, which still load and merge):
                 one entry per backend x dtype x invariance relation whose test ran (below)
    op_invariance
                 array (optional, as ``invariance``): one entry per backend x dtype x op checked for
                 batch invariance (below)
    problems     array: the tests that broke rather than failed (below); when not empty the run's
                 verdict is incomplete and it exited 6
    deviations   array: the entries of the known-deviations files the run was given (below)

Numbers.  JSON has no infinities or NaN: a measured value that is not finite is written as the string
``"inf"``, ``"-inf"`` or ``"nan"`` (``number()`` reads any number field back as a float).  ``null``
means "not measured" (an op with no examples has no error statistics).

``environment``::

    suite_version  the installed gemma4-conformance version ("unknown" when it is not installed)
    python         the Python version and implementation, e.g. "3.11.7 (CPython)"
    platform       platform.platform(): operating system, kernel, libc
    machine        the architecture, e.g. "x86_64"
    cpu            the processor's model name (/proc/cpuinfo on Linux, else platform.processor())
    cpu_count      logical CPUs (os.cpu_count())
    accelerators   array of strings: the GPUs or TPUs the run's libraries saw, e.g.
                   "torch cuda:0 NVIDIA H200"; empty when none, or when no library that can see one
                   was imported by the run
    libraries      object: library name -> installed version, for those of numpy, torch, jax,
                   jaxlib, transformers, ml_dtypes, mpmath, hypothesis that are installed
    date           when the document was made, ISO 8601 in UTC, e.g. "2025-11-30T06:20:00+00:00"
    backends       object (optional; absent in documents from before it): adapter name -> where that
                   backend ran and how it rounds, from its ``environment()`` when it has one:
                   ``device`` ("cpu", "cuda:0", "gpu:0"; every backend has it), ``device_name``,
                   ``library``, ``runtime`` (CUDA/ROCm/JAX platform version), ``cudnn``, ``driver``,
                   ``math_modes`` (object: the settings that decide rounding, e.g. torch's TF32 flags by
                   its old and new APIs, its reduced-precision bf16/fp16 reductions and float32 matmul
                   precision, JAX's jax_default_matmul_precision and the backend's own),
                   ``math_modes_source`` (whether the backend forced them or found them) and
                   ``math_summary`` (the modes that change a verdict, in a few words), and
                   ``dtypes`` (those the backend declares; ``dtypes_left_out``: dtype -> why not, where
                   it says), and kernel-specific keys (``sdpa_kernels_run``: dtype -> the SDPA kernels
                   torch chose)

    Further keys (JSON values) may be given by the caller of ``environment(**extra)``, e.g. the
    command line, the Hypothesis profile, or a ``label`` naming the run in a merged page.

``results[i]`` (sorted by backend, dtype float64 float32 bfloat16 float16, op in the contract's order)::

    backend         the adapter's name
    dtype           "float64", "float32", "bfloat16" or "float16"
    op              the op's name in spec/contract.py
    outcome         "passed", "failed", "known deviation" (failed, and excused by a known-deviations
                    file), "errored" (the backend raised, or broke the contract: wrong shape or
                    dtype), "not established" (no example failed, but too few were informative:
                    properties/record.py MIN_INFORMATIVE), "unsupported" (the adapter lacks the op),
                    or "not run"
    deviation       the known-deviation entry's reason when one covers this result, else ""
    examples        number of examples judged (an integer)
    informative     how many of them were evidence: their allowance excluded every trivially wrong
                    answer (zeros, the sign flipped; for attention also uniform weights and each query
                    head zeroed), so a backend computing those would have failed (an integer)
    worst_ulps      the error of the worst example: the one with the least headroom, whose error is
                    the largest fraction of its budget (a budget depends on the example's dimensions,
                    so this need not be the largest error), in ULPs of the dtype at the op's scale
                    (properties/error_models.py), or at the second tier's scale where that tier had
                    less headroom; null with no examples
    budget_ulps     that example's budget, ULPs at the scale (the second tier's: its budget plus the
                    factor times the plain arrangements' error on that example); null with no examples
    headroom        budget_ulps / worst_ulps: above 1 the op passed with that factor to spare, below 1
                    it failed by that factor; "inf" when every example was exact; null with no examples
    max_ulps        the largest error of any example, ULPs at the scale; null with no examples
    p99_ulps        the 99th percentile of the examples' largest errors, ULPs; null with no examples
    median_ulps     their median, ULPs; null with no examples
    budget_formula  the budget's formula in properties/tolerances.yaml, e.g. "3.5 + 1.5 * fn", and the
                    second tier's where the op has one
    error_model     the error model the formula comes from, in words
    worst_case      the input case of the example with the least headroom (the JSON that
                    ``--case`` takes); for an "errored" op the case the backend broke on; or null
    rerun           the shell command that reruns exactly that case ("" when none was recorded)
    message         the worst example's failure message, or the error ("" when the op passed)
    histogram       array of numbers: each example's largest error as a fraction of its own budget
                    (above 1 is beyond it), 4 significant digits,
                    in the order drawn; above 500 examples, 500 order statistics evenly spaced
                    from the smallest to the largest (so the distribution's shape, minimum and
                    maximum are kept), sorted ascending
    seconds         object (optional; absent in documents from before it): wall seconds summed over the
                    examples: "backend" (the adapter's call, less its transfers), "transfer" (moving
                    arrays to and from its device, for adapters that count it: torch and jax on a
                    GPU) and "oracle" (the exact result, its scale and the comparison)
    oracle_share    number or null: the share of the output elements judged whose verdict the first
                    stage's enclosures (spec/enclosures.py) left to the oracle

``forward[i]`` (sorted by backend, then dtype)::

    backend         the adapter's name ("torch (12B)" for the real-geometry run)
    dtype           the forward's dtype
    outcome         "passed" or "failed"
    layers          {"candidate": [...], "baseline": [...]}: per decoder layer, the relative error
                    (Frobenius norm of the difference over that of the reference) of the backend's
                    hidden state and of the plain same-dtype baseline's, against the certified
                    float64 reference; empty when the backend's own forward returns no hidden states
    logits          {"candidate": x, "baseline": y}: the same relative errors for the logits
    top1_agreement  fraction (0 to 1) of positions whose top-1 token matches the reference's
    logprob_gap     {"candidate": x, "baseline": y}: the largest |log p - log p_ref| over positions
                    and tokens, in nats
    local           null when the backend gives no hidden states; else each layer's and the head's
                    own error, the stream reset to the backend's at every layer (forward.local_errors):
                    {"layers": {"candidate": [...], "baseline": [...]}, "logits": {...},
                    "logprob_gap": {...}}, as above but for one layer (or the head) on the backend's
                    own input to it
    factor          how many times the baseline's own error (``local``; without it the accumulated
                    logits' error) the candidate may have (the verdict's FACTOR)
    accumulated_factor
                    how many times the baseline's accumulated errors (``layers``, ``logits``,
                    ``logprob_gap``) the candidate may have: ACCUMULATED with ``local``, else FACTOR
    floor           the absolute relative error always allowed (FLOOR unit roundoffs of the dtype)
    failures        array of strings: why the verdict failed (empty when it passed)
    rerun           the command that reruns this forward test (it is deterministic: the generated
                    checkpoint and the tokens are seeded; ``--weights`` is repeated when it was given)
    deviation       as in ``results``; outcome "known deviation" when it excused a failure

``traces[i]`` (sorted by backend, then dtype; properties/trace.py)::

    backend, dtype  as in ``forward``
    outcome         "passed" (every judged node within its op's budget), "failed" or "known deviation"
    summary         one line: the first departing node, or that none departs, and how many nodes were
                    not judged
    first_departure null when no node failed, else the first failed node in graph order:
                    {"node", "op", "layer" (an integer, null for embed, final_norm, logits),
                    "error", "budget" (ULPs of the dtype at the op's scale), "message"}
    work            oracle multiply-adds spent on each judged node (its sample's size)
    layers          array, one row per "embed", "layer 0" ... "final": {"where", "nodes", "judged",
                    "passed", "failed", "not traced", "inputs not traced" (integers), "failed_nodes"
                    (the failed nodes' names within the layer, e.g. "q_norm")}
    nodes           array, every node of the graph in graph order: {"node", "op", "outcome" ("passed",
                    "failed", "not traced": the trace omits it, "inputs not traced": an input was not
                    traced, so it is not judged), "error", "budget" (null when not judged; for
                    attention the tier with the least headroom), "message" (why it failed, or which
                    inputs were missing; "" when it passed), "informative" (false when the node's
                    budget would also admit a trivially wrong answer there, as ``results``' examples)}
    failures        array of strings: why the verdict failed (empty when it passed)
    rerun           the command that reruns this trace's test (deterministic, like the forward's)

``serving[i]`` (sorted by backend, then dtype; properties/serving.py)::

    backend, dtype  as in ``forward``
    outcome         "passed", "failed", "known deviation", "errored" (the session raised or broke
                    its contract) or "unsupported" (the adapter has no ``session``)
    schedules       schedules played (an integer; Hypothesis's shrinking included)
    sequences, steps, tokens
                    integers: the sequences of those schedules, the steps they took, and the tokens
                    appended, each of which returned a logit row that was judged
    worst           the row nearest what the verdict allows, or null when none was judged:
                    {"ratio": its relative error over ``factor`` x the baseline's (or the floor),
                    "error", "baseline": the relative errors of the row and of the baseline's row
                    against the reference, "sequence": its index in the schedule, "position",
                    "decode": true for a decode step's row, false for a prefill chunk's,
                    "schedule": the schedule}
    factor, floor   as in ``forward``; the factor is the serving verdict's (properties/serving.FACTOR,
                    the forward's for accumulated errors: a session gives logits only)
    failing         failing schedules judged (an integer; Hypothesis's shrinking included)
    failing_features
                    object: feature ("chunking", "wrap-around", "reuse", "mixed batch") -> how many
                    of the failing schedules have it
    case            the last failing schedule (Hypothesis replays the minimal one last; the JSON
                    ``--case`` takes), or the one the session broke on; null when none
    features        array of strings: that schedule's features
    message         why it failed or broke ("" when it passed)
    rerun           the command that reruns that schedule ("" when none)
    deviation       as in ``results``

``invariance[i]`` (sorted by backend, dtype, then relation; properties/invariance.py)::

    backend, dtype  as in ``serving``
    relation        "run", "batch" or "chunk"
    claimed         true when the adapter promises it (its ``invariance``): then a difference fails the run
    outcome         "held", "varies" (not claimed, and it does not hold: measured, not a failure),
                    "failed" (claimed, and it does not hold), "errored", "unsupported" (no session)
    schedules       schedules compared (an integer; Hypothesis's shrinking included)
    rows, differing integers: the logit rows compared bitwise, and those that differ
    worst           the difference of the most ULPs, or null when every row was identical:
                    {"sequence", "position" (the first differing one), "rows" (how many differ),
                    "ulps" (the largest difference, in ULPs of the dtype), "against" (what was compared),
                    "schedule"}
    message         the first difference found, every sequence of its schedule ("" when it held)
    rerun           the command that replays that schedule ("" when it held)

``op_invariance[i]`` (sorted by backend, dtype, then op)::

    backend, dtype, op
    nodes           the forward's nodes of that op that were checked (its first ones)
    rows            rows computed alone (and, for linear, gate_up and lm_head, in blocks) and compared
    differing       of those, rows that differ from the same rows in the whole call: 0 when the op is
                    batch-invariant
    ulps            the largest difference in ULPs of the dtype
    where           the first difference: the node and how its rows were split ("" when none)

``relations[i]`` (sorted like ``results``)::

    backend, dtype  as in ``results``
    relation        the theorem's name in properties/relations.py, e.g. "softmax_sums_to_one"
    ops             array of strings: the ops it relates
    outcome         as in ``results``
    examples        number of examples checked (an integer; Hypothesis's shrinking included)
    message         the first violation found ("" when it held)
    rerun           the command that reruns the minimal violating case, or the case the backend raised
                    on ("" when it held)
    deviation       as in ``results``

``problems[i]``::

    test            the pytest node id
    phase           "setup", "call" or "teardown"
    message         the exception, one line of type and message (at most 2000 characters)

``deviations[i]``::

    backend, op, dtype, reason, file   the entry as written in its file
    status          "excused" (a test it covers failed and was excused), "conforms" (its tests all
                    passed: the entry may be stale), "not judged" (its tests were skipped or broke)
                    or "unmatched" (it covers no test of the run)
    tests           array of strings: the node ids of the tests it covers
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import numpy as np

from gemma4_conformance.adapters import DTYPES
from gemma4_conformance.properties.budget import budget
from gemma4_conformance.properties.forward import ACCUMULATED, FACTOR, FLOOR
from gemma4_conformance.properties.serving import FACTOR as SERVING_FACTOR
from gemma4_conformance.properties.record import reported
from gemma4_conformance.spec import CONTRACT, fmt

SCHEMA = "gemma4-conformance-report"
VERSION = 5
HISTOGRAM_CAP = 500
OUTCOMES = ("passed", "failed", "known deviation", "errored", "not established", "unsupported", "not run")
LIBRARIES = ("numpy", "torch", "jax", "jaxlib", "transformers", "ml_dtypes", "mpmath", "hypothesis")

RESULT_FIELDS = {
    "backend": str, "dtype": str, "op": str, "outcome": str, "examples": int, "informative": int, "worst_ulps": "number",
    "budget_ulps": "number", "headroom": "number", "max_ulps": "number", "p99_ulps": "number", "median_ulps": "number",
    "budget_formula": str, "error_model": str, "worst_case": (dict, type(None)),
    "rerun": str, "message": str, "histogram": list, "deviation": str,
}
RELATION_FIELDS = {
    "backend": str, "dtype": str, "relation": str, "ops": list, "outcome": str, "examples": int, "message": str,
    "rerun": str, "deviation": str,
}
PROBLEM_FIELDS = {"test": str, "phase": str, "message": str}
DEVIATION_FIELDS = {"backend": str, "op": str, "dtype": str, "reason": str, "file": str, "status": str,
                    "tests": list}
FORWARD_FIELDS = {
    "backend": str, "dtype": str, "outcome": str, "layers": dict, "logits": dict, "top1_agreement": "number",
    "logprob_gap": dict, "local": (dict, type(None)), "factor": "number", "accumulated_factor": "number",
    "floor": "number", "failures": list, "rerun": str, "deviation": str,
}
TRACE_FIELDS = {
    "backend": str, "dtype": str, "outcome": str, "summary": str, "first_departure": (dict, type(None)),
    "work": int, "layers": list, "nodes": list, "failures": list, "rerun": str, "deviation": str,
}
NODE_FIELDS = {"node": str, "op": str, "outcome": str, "error": "number", "budget": "number", "message": str,
               "informative": bool}
NODE_OUTCOMES = ("passed", "failed", "not traced", "inputs not traced")
SERVING_FIELDS = {
    "backend": str, "dtype": str, "outcome": str, "schedules": int, "sequences": int, "steps": int, "tokens": int,
    "worst": (dict, type(None)), "factor": "number", "floor": "number", "failing": int, "failing_features": dict,
    "case": (dict, type(None)), "features": list, "message": str, "rerun": str, "deviation": str,
}
INVARIANCE_FIELDS = {
    "backend": str, "dtype": str, "relation": str, "claimed": bool, "outcome": str, "schedules": int, "rows": int,
    "differing": int, "worst": (dict, type(None)), "message": str, "rerun": str,
}
INVARIANCE_OUTCOMES = ("held", "varies", "failed", "errored", "unsupported", "not run")
OP_INVARIANCE_FIELDS = {"backend": str, "dtype": str, "op": str, "nodes": int, "rows": int, "differing": int,
                        "ulps": "number", "where": str}
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class ReportError(ValueError):
    """A file that is not a report this suite can read; the message names the file and what is wrong."""


# ----------------------------------------------------------------------------------------- numbers

def encode(x) -> float | str | None:
    """A number for the document: a finite float, "inf", "-inf" or "nan"; None stays None."""
    if x is None:
        return None
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def number(value) -> float | None:
    """A number field of a document as a float (``"inf"`` -> inf); None (not measured) stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        return _NON_FINITE[value]
    return float(value)


def _is_number(value) -> bool:
    if isinstance(value, str):
        return value in _NON_FINITE
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


# ----------------------------------------------------------------------------------------- building

def dtype_rank(dtype: str) -> tuple:
    """Sort key: the suite's dtypes widest first, any other (from another version's document) after."""
    return (DTYPES.index(dtype), "") if dtype in DTYPES else (len(DTYPES), dtype)


def _jsonable(value):
    """A JSON-able copy of a case (numpy scalars and arrays become Python numbers and lists)."""
    return json.loads(json.dumps(value, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


def _histogram(values) -> list:
    values = [float(v) for v in values]
    if len(values) > HISTOGRAM_CAP:
        ordered = np.sort(np.asarray(values))
        values = ordered[np.linspace(0, len(ordered) - 1, HISTOGRAM_CAP).round().astype(int)].tolist()
    return [encode(float(f"{v:.4g}")) if math.isfinite(v) else encode(v) for v in values]


def result_entry(record, excused: dict | None = None) -> dict:
    """One ``results`` entry from a ``properties.record.OpRecord``; ``excused`` maps (backend, dtype, op)
    to the reason of the known deviation that covers it."""
    measured = bool(record.per_example)
    b = budget(record.op, record.dtype)
    deviation = (excused or {}).get((record.backend, record.dtype, record.op), "")
    return {
        "backend": record.backend,
        "dtype": record.dtype,
        "op": record.op,
        "outcome": reported(record.outcome, deviation),
        "examples": int(record.examples),
        "informative": int(record.informative),
        "worst_ulps": encode(record.worst_ulps) if measured else None,
        "budget_ulps": encode(record.budget) if measured else None,
        "headroom": encode(record.headroom) if measured else None,
        "max_ulps": encode(record.max_ulps) if measured else None,
        "p99_ulps": encode(record.quantile(0.99)) if measured else None,
        "median_ulps": encode(record.quantile(0.5)) if measured else None,
        "budget_formula": b.formula + (f"; second tier {b.tier2.formula} + {b.factor:g} x the plain arrangements' error"
                                       if b.tier2 else ""),
        "error_model": b.model + (f" Second tier: {b.tier2.model}" if b.tier2 else ""),
        "worst_case": _jsonable(record.worst_case) if record.worst_case is not None else None,
        "rerun": record.worst_command,
        "message": record.message,
        "histogram": _histogram(record.fractions),
        "deviation": deviation,
        "seconds": {part: round(value, 6) for part, value in record.seconds.items()},
        "oracle_share": encode(record.by_oracle / record.checked) if record.checked else None,
    }


def relation_entry(record, excused: dict | None = None) -> dict:
    """One ``relations`` entry from a ``properties.record.RelationRecord``."""
    deviation = (excused or {}).get((record.backend, record.dtype, record.relation), "")
    return {
        "backend": record.backend,
        "dtype": record.dtype,
        "relation": record.relation,
        "ops": list(record.ops),
        "outcome": reported(record.outcome, deviation),
        "examples": int(record.examples),
        "message": record.message,
        "rerun": record.rerun,
        "deviation": deviation,
    }


def deviation_entry(entry) -> dict:
    """One ``deviations`` entry from a ``properties.deviations.Deviation``."""
    return {"backend": entry.backend, "op": entry.op, "dtype": entry.dtype, "reason": entry.reason,
            "file": entry.file, "status": entry.status, "tests": list(entry.matched)}


def forward_entry(backend: str, dtype: str, verdict, deviation: str = "") -> dict:
    """One ``forward`` entry from a ``properties.forward.ForwardVerdict`` (or any object with its fields)."""
    failures = [str(f) for f in verdict.failures]
    return {
        "backend": backend,
        "dtype": dtype,
        "outcome": reported("failed" if failures else "passed", deviation),
        "layers": {"candidate": [encode(c) for c, _ in verdict.layers],
                   "baseline": [encode(b) for _, b in verdict.layers]},
        "logits": {"candidate": encode(verdict.logits[0]), "baseline": encode(verdict.logits[1])},
        "top1_agreement": encode(verdict.top1_agreement),
        "logprob_gap": {"candidate": encode(verdict.logprob_gap[0]), "baseline": encode(verdict.logprob_gap[1])},
        "local": _local(verdict),
        "factor": encode(FACTOR),
        "accumulated_factor": encode(ACCUMULATED if getattr(verdict, "local_layers", None) else FACTOR),
        "floor": encode(FLOOR * fmt(dtype).eps),
        "failures": failures,
        "rerun": verdict.rerun,
        "deviation": deviation,
    }


def _local(verdict) -> dict | None:
    """The layers' and the head's own errors (``local`` in the schema), None when not measured."""
    layers = getattr(verdict, "local_layers", None)
    if not layers:
        return None
    pair = (lambda p: {"candidate": encode(p[0]), "baseline": encode(p[1])})
    return {"layers": {"candidate": [encode(c) for c, _ in layers], "baseline": [encode(b) for _, b in layers]},
            "logits": pair(verdict.local_logits), "logprob_gap": pair(verdict.local_logprob_gap)}


def _node(n) -> dict:
    return {"node": n.node, "op": n.op, "outcome": n.outcome, "error": encode(n.error),
            "budget": encode(n.budget), "message": n.message, "informative": bool(n.informative)}


def trace_entry(backend: str, dtype: str, verdict, deviation: str = "") -> dict:
    """One ``traces`` entry from a ``properties.trace.TraceVerdict``."""
    failures = [str(f) for f in verdict.failures]
    first = verdict.first_departure
    return {
        "backend": backend,
        "dtype": dtype,
        "outcome": reported("failed" if failures else "passed", deviation),
        "summary": verdict.summary(),
        "first_departure": None if first is None else {**_node(first), "layer": first.layer},
        "work": int(verdict.work),
        "layers": [{k: v for k, v in row.items()} for row in verdict.by_layer()],
        "nodes": [_node(n) for n in verdict.nodes],
        "failures": failures,
        "rerun": verdict.rerun,
        "deviation": deviation,
    }


def serving_entry(record, deviation: str = "") -> dict:
    """One ``serving`` entry from a ``properties.serving.ServingRecord``."""
    w = record.worst
    worst = None if w is None else {
        "ratio": encode(w.ratio), "error": encode(w.error), "baseline": encode(w.baseline), "sequence": w.sequence,
        "position": w.position, "decode": w.decode, "schedule": _jsonable(w.schedule)}
    return {
        "backend": record.backend,
        "dtype": record.dtype,
        "outcome": reported(record.outcome, deviation),
        "schedules": record.schedules,
        "sequences": record.sequences,
        "steps": record.steps,
        "tokens": record.tokens,
        "worst": worst,
        "factor": encode(SERVING_FACTOR),
        "floor": encode(FLOOR * fmt(record.dtype).eps),
        "failing": record.failing,
        "failing_features": dict(record.failing_features),
        "case": _jsonable(record.case) if record.case is not None else None,
        "features": list(record.features),
        "message": record.message,
        "rerun": record.rerun,
        "deviation": deviation,
    }


def invariance_entry(record) -> dict:
    """One ``invariance`` entry from a ``properties.invariance.InvarianceRecord``."""
    w = record.worst
    worst = None if w is None else {"sequence": w.sequence, "position": w.position, "rows": w.rows,
                                    "ulps": encode(w.ulps), "against": w.against, "schedule": _jsonable(w.schedule)}
    return {"backend": record.backend, "dtype": record.dtype, "relation": record.relation, "claimed": record.claimed,
            "outcome": record.outcome, "schedules": record.schedules, "rows": record.rows,
            "differing": record.differing, "worst": worst, "message": record.message, "rerun": record.rerun}


def op_invariance_entry(record) -> dict:
    """One ``op_invariance`` entry from a ``properties.invariance.OpInvarianceRecord``."""
    return {"backend": record.backend, "dtype": record.dtype, "op": record.op, "nodes": record.nodes,
            "rows": record.rows, "differing": record.differing, "ulps": encode(record.ulps), "where": record.where}


def document(recorder, env: dict | None = None, deviations=()) -> dict:
    """The report document of a run: ``recorder`` is the plugin's ``properties.record.Recorder``;
    ``env`` is ``environment()``'s dict (collected now when None); ``deviations`` the
    known-deviations entries (``properties.deviations.Deviation``) the run was given."""
    ops = list(CONTRACT)
    records = sorted(recorder.records.values(), key=lambda r: (r.backend, dtype_rank(r.dtype), ops.index(r.op)))
    relations = sorted(recorder.relations.values(), key=lambda r: (r.backend, dtype_rank(r.dtype), r.relation))
    forward = sorted(recorder.forward.items(), key=lambda item: (item[0][0], dtype_rank(item[0][1])))
    traces = sorted(recorder.traces.items(), key=lambda item: (item[0][0], dtype_rank(item[0][1])))
    excused = recorder.excused
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "environment": _jsonable(environment() if env is None else env),
        "results": [result_entry(r, excused) for r in records],
        "relations": [relation_entry(r, excused) for r in relations],
        "forward": [forward_entry(backend, dtype, v, excused.get((backend, dtype, "forward"), ""))
                    for (backend, dtype), v in forward],
        "traces": [trace_entry(backend, dtype, v, excused.get((backend, dtype, "trace"), ""))
                   for (backend, dtype), v in traces],
        "serving": [serving_entry(r, excused.get((backend, dtype, "serving"), ""))
                    for (backend, dtype), r in sorted(recorder.serving.items(),
                                                      key=lambda item: (item[0][0], dtype_rank(item[0][1])))],
        "invariance": [invariance_entry(r) for r in sorted(recorder.invariance.values(), key=lambda r: (
            r.backend, dtype_rank(r.dtype), r.relation))],
        "op_invariance": [op_invariance_entry(r) for r in sorted(recorder.op_invariance.values(), key=lambda r: (
            r.backend, dtype_rank(r.dtype), ops.index(r.op)))],
        "problems": [{"test": p.test, "phase": p.phase, "message": p.message} for p in recorder.problems],
        "deviations": [deviation_entry(e) for e in deviations],
    }


# ----------------------------------------------------------------------------------------- environment

def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _accelerators() -> list[str]:
    """The devices of libraries the run already imported (importing one here would cost seconds)."""
    found = []
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                found += [f"torch cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
        except Exception:  # noqa: BLE001, S110 -- a broken driver must not lose the report; devices only inform
            pass
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            found += [f"jax {d.platform}:{d.id} {d.device_kind}" for d in jax.devices() if d.platform != "cpu"]
        except Exception:  # noqa: BLE001, S110 -- likewise
            pass
    return found


def _libraries() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "__version__"):
                versions[name] = str(module.__version__)
    return versions


def backend_environment(adapter) -> dict:
    """Where ``adapter`` ran and the math modes in force (``backends`` in the schema above)."""
    env = {}
    if hasattr(adapter, "environment"):
        try:
            env = dict(adapter.environment())
        except Exception as e:  # noqa: BLE001 - an adapter's broken environment() must not lose the report
            env = {"environment_error": f"{type(e).__name__}: {e}"}
    env.setdefault("device", getattr(adapter, "device", None) or "not given (the adapter names no device)")
    env["device"] = str(env["device"])  # a torch.device, say (transformers' backend gives one)
    env.setdefault("dtypes", list(adapter.dtypes))
    return env


def device_line(adapter) -> str:
    """One line for the terminal: the backend's device, its name, and its math summary."""
    env = backend_environment(adapter)
    name = env.get("device_name")
    return (env["device"] + (f" ({name})" if name and name != env["device"] and name != "cpu" else "")
            + (f"; {env['math_summary']}" if env.get("math_summary") else ""))


def environment(backends=None, **extra) -> dict:
    """Where and with what this process runs (see the schema above); ``backends`` are the run's adapters,
    each described under ``backends``; ``extra`` keys are added as given."""
    try:
        suite = metadata.version("gemma4-conformance")
    except metadata.PackageNotFoundError:
        suite = "unknown"
    env = {
        "suite_version": suite,
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu(),
        "cpu_count": os.cpu_count(),
        "accelerators": _accelerators(),
        "libraries": _libraries(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if backends is not None:
        env["backends"] = {adapter.name: backend_environment(adapter) for adapter in backends}
    env.update(extra)
    return env


# ----------------------------------------------------------------------------------------- files

def dump(document: dict, path) -> Path:
    """Write ``document`` as JSON to ``path`` (its folder is created); returns the path."""
    path = Path(path)
    validate(document, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _check_fields(entry, fields: dict, where: str, source: str) -> None:
    if not isinstance(entry, dict):
        raise ReportError(f"{source}: {where} is {type(entry).__name__}, expected an object")
    for key, kind in fields.items():
        if key not in entry:
            raise ReportError(f"{source}: {where} lacks the field {key!r}")
        value = entry[key]
        if kind == "number":
            ok = _is_number(value)
        else:
            ok = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            expected = "a number, null, or \"inf\"/\"-inf\"/\"nan\"" if kind == "number" else \
                " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ReportError(f"{source}: {where}.{key} is {value!r:.60}, expected {expected}")


def validate(document, source: str = "<document>") -> dict:
    """Check that ``document`` is a report of this VERSION; raise ``ReportError`` naming ``source`` otherwise."""
    if not isinstance(document, dict):
        raise ReportError(f"{source}: not a {SCHEMA} (the top level is {type(document).__name__}, "
                          f"expected an object)")
    schema = document.get("schema")
    if schema != SCHEMA:
        raise ReportError(f"{source}: not a {SCHEMA}: its \"schema\" is {schema!r}, expected {SCHEMA!r}")
    version = document.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ReportError(f"{source}: \"version\" is {version!r}, expected an integer")
    if version != VERSION:
        newer = "newer than" if version > VERSION else "older than"
        raise ReportError(f"{source}: report schema version {version} is {newer} the version this suite reads "
                          f"({VERSION}); render it with the gemma4-conformance that wrote it")
    for key, kind in (("environment", dict), ("results", list), ("relations", list), ("forward", list),
                      ("traces", list), ("serving", list), ("problems", list), ("deviations", list)):
        if not isinstance(document.get(key), kind):
            raise ReportError(f"{source}: \"{key}\" is missing or not an {'object' if kind is dict else 'array'}")
    for i, entry in enumerate(document["results"]):
        _check_fields(entry, RESULT_FIELDS, f"results[{i}]", source)
        if entry["outcome"] not in OUTCOMES:
            raise ReportError(f"{source}: results[{i}].outcome is {entry['outcome']!r}, expected one of {OUTCOMES}")
        if not all(_is_number(v) for v in entry["histogram"]):
            raise ReportError(f"{source}: results[{i}].histogram holds a value that is not a number")
    for i, entry in enumerate(document["relations"]):
        _check_fields(entry, RELATION_FIELDS, f"relations[{i}]", source)
        if entry["outcome"] not in OUTCOMES:
            raise ReportError(f"{source}: relations[{i}].outcome is {entry['outcome']!r}, expected one of {OUTCOMES}")
    for i, entry in enumerate(document["problems"]):
        _check_fields(entry, PROBLEM_FIELDS, f"problems[{i}]", source)
    for i, entry in enumerate(document["deviations"]):
        _check_fields(entry, DEVIATION_FIELDS, f"deviations[{i}]", source)
    for i, entry in enumerate(document["serving"]):
        _check_fields(entry, SERVING_FIELDS, f"serving[{i}]", source)
        if entry["outcome"] not in OUTCOMES:
            raise ReportError(f"{source}: serving[{i}].outcome is {entry['outcome']!r}, expected one of {OUTCOMES}")
    _validate_invariance(document, source)
    for i, entry in enumerate(document["forward"]):
        _check_fields(entry, FORWARD_FIELDS, f"forward[{i}]", source)
        for key in ("layers", "logits", "logprob_gap"):
            if not {"candidate", "baseline"} <= set(entry[key]):
                raise ReportError(f"{source}: forward[{i}].{key} needs \"candidate\" and \"baseline\"")
    for i, entry in enumerate(document["traces"]):
        _check_fields(entry, TRACE_FIELDS, f"traces[{i}]", source)
        for j, node in enumerate(entry["nodes"]):
            _check_fields(node, NODE_FIELDS, f"traces[{i}].nodes[{j}]", source)
            if node["outcome"] not in NODE_OUTCOMES:
                raise ReportError(f"{source}: traces[{i}].nodes[{j}].outcome is {node['outcome']!r}, expected one "
                                  f"of {NODE_OUTCOMES}")
    return document


def _validate_invariance(document: dict, source: str) -> None:
    """The optional invariance keys, when present (a document written before them has neither)."""
    for key, fields in (("invariance", INVARIANCE_FIELDS), ("op_invariance", OP_INVARIANCE_FIELDS)):
        if key not in document:
            continue
        if not isinstance(document[key], list):
            raise ReportError(f"{source}: \"{key}\" is not an array")
        for i, entry in enumerate(document[key]):
            _check_fields(entry, fields, f"{key}[{i}]", source)
            if key == "invariance" and entry["outcome"] not in INVARIANCE_OUTCOMES:
                raise ReportError(f"{source}: invariance[{i}].outcome is {entry['outcome']!r}, expected one of "
                                  f"{INVARIANCE_OUTCOMES}")


def load(path) -> dict:
    """Read and validate a JSON report written by ``dump``; ``ReportError`` names the file otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ReportError(f"{path}: cannot read the report: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not a {SCHEMA} (not UTF-8 text)") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not a {SCHEMA}: invalid JSON at line {e.lineno} column {e.colno}: "
                          f"{e.msg}") from None
    return validate(doc, str(path))
