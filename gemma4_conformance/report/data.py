"""The report document: one conformance run as a plain, JSON-able dict, validated against report/schema.py.

``document(recorder, environment())`` builds it from the pytest plugin's ``Recorder``; ``dump`` writes it
as JSON and ``load`` reads one back.  Why a page is rendered from documents only: docs/report.md.
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

from gemma4_conformance.adapters import DTYPES, declared_formats
from gemma4_conformance.properties.budget import budget
from gemma4_conformance.properties.forward import ACCUMULATED, FACTOR, FLOOR
from gemma4_conformance.spec import CONTRACT, format_of

from .record import reported
from .schema import (
    DEVIATION_FIELDS,
    DOCUMENT_FIELDS,
    FORWARD_FIELDS,
    HISTOGRAM_CAP,
    INVARIANCE_FIELDS,
    INVARIANCE_OUTCOMES,
    LIBRARIES,
    NODE_FIELDS,
    NODE_OUTCOMES,
    OP_INVARIANCE_FIELDS,
    OUTCOMES,
    PROBLEM_FIELDS,
    RELATION_FIELDS,
    RESULT_FIELDS,
    SCHEMA,
    SERVING_FIELDS,
    TRACE_FIELDS,
    VERSION,
)

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
    """``values`` to 4 significant digits; above HISTOGRAM_CAP, that many evenly spaced order statistics."""
    values = [float(v) for v in values]
    if len(values) > HISTOGRAM_CAP:
        ordered = np.sort(np.asarray(values))
        values = ordered[np.linspace(0, len(ordered) - 1, HISTOGRAM_CAP).round().astype(int)].tolist()
    return [encode(float(f"{v:.4g}")) if math.isfinite(v) else encode(v) for v in values]


def result_entry(record, excused: dict | None = None) -> dict:
    """One ``results`` entry from a ``report.record.OpRecord``; ``excused`` maps (backend, dtype, op)
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
        "error_model": b.model + (f" Second tier: {b.tier2.model}" if b.tier2 else "") + "".join(
            f" Declared {key} ({name}): {b.declared[key]}" for key, name in sorted(record.formats.items())),
        "worst_case": _jsonable(record.worst_case) if record.worst_case is not None else None,
        "rerun": record.worst_command,
        "message": record.message,
        "histogram": _histogram(record.fractions),
        "deviation": deviation,
        "seconds": {part: round(value, 6) for part, value in record.seconds.items()},
        "oracle_share": encode(record.by_oracle / record.checked) if record.checked else None,
        "formats": dict(record.formats),
        "declared_dominant": int(record.dominated),
        "given": record.given,
    }


def relation_entry(record, excused: dict | None = None) -> dict:
    """One ``relations`` entry from a ``report.record.RelationRecord``."""
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
        "floor": encode(FLOOR * format_of(dtype).eps),
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
    """A trace node (``properties.trace.NodeVerdict``) as the document holds it."""
    return {"node": n.node, "op": n.op, "outcome": n.outcome, "error": encode(n.error),
            "budget": encode(n.budget), "message": n.message, "informative": bool(n.informative),
            "given": n.given}


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
        "factor": encode(ACCUMULATED),
        "floor": encode(FLOOR * format_of(record.dtype).eps),
        "failing": record.failing,
        "failing_features": dict(record.failing_features),
        "case": _jsonable(record.case) if record.case is not None else None,
        "features": list(record.features),
        "message": record.message,
        "rerun": record.rerun,
        "deviation": deviation,
    }


def invariance_entry(record, excused: dict | None = None) -> dict:
    """One ``invariance`` entry from a ``properties.invariance.InvarianceRecord``; ``excused`` as for
    ``result_entry``, keyed by (backend, dtype, "invariance:relation")."""
    deviation = (excused or {}).get((record.backend, record.dtype, f"invariance:{record.relation}"), "")
    w = record.worst
    worst = None if w is None else {"sequence": w.sequence, "position": w.position, "rows": w.rows,
                                    "scaled": encode(w.scaled), "ulps": encode(w.ulps), "against": w.against,
                                    "schedule": _jsonable(w.schedule)}
    return {"backend": record.backend, "dtype": record.dtype, "relation": record.relation, "claimed": record.claimed,
            "outcome": reported(record.outcome, deviation), "schedules": record.schedules, "rows": record.rows,
            "differing": record.differing, "worst": worst, "message": record.message, "rerun": record.rerun,
            "first_node": record.first_node, "deviation": deviation}


def op_invariance_entry(record) -> dict:
    """One ``op_invariance`` entry from a ``properties.invariance.OpInvarianceRecord``."""
    return {"backend": record.backend, "dtype": record.dtype, "op": record.op, "nodes": record.nodes,
            "rows": record.rows, "differing": record.differing, "scaled": encode(record.scaled),
            "ulps": encode(record.ulps), "where": record.where, "repeated": record.repeated,
            "unrepeated": record.unrepeated, "run_where": record.run_where}


def document(recorder, env: dict | None = None, deviations=()) -> dict:
    """The report document of a run: ``recorder`` is the plugin's ``report.record.Recorder``;
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
        "invariance": [invariance_entry(r, excused) for r in sorted(recorder.invariance.values(), key=lambda r: (
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
    """The installed versions of LIBRARIES (a module's ``__version__`` where the package has no metadata)."""
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
    """Where ``adapter`` ran and the math modes in force (the environment's ``backends`` in report/schema.py)."""
    env = {}
    if hasattr(adapter, "environment"):
        try:
            env = dict(adapter.environment())
        except Exception as e:  # noqa: BLE001 - an adapter's broken environment() must not lose the report
            env = {"environment_error": f"{type(e).__name__}: {e}"}
    env.setdefault("device", getattr(adapter, "device", None) or "not given (the adapter names no device)")
    env["device"] = str(env["device"])  # a torch.device, say (transformers' backend gives one)
    env.setdefault("dtypes", list(adapter.dtypes))
    if declared_formats(adapter):
        env["formats"] = declared_formats(adapter)
    return env


def device_line(adapter) -> str:
    """One line for the terminal: the backend's device, its name, and its math summary."""
    env = backend_environment(adapter)
    name = env.get("device_name")
    return (env["device"] + (f" ({name})" if name and name != env["device"] and name != "cpu" else "")
            + (f"; {env['math_summary']}" if env.get("math_summary") else ""))


def environment(backends=None, **extra) -> dict:
    """Where and with what this process runs (the schema's ENVIRONMENT_FIELDS); ``backends`` are the run's adapters,
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
    """Write ``document`` as JSON to ``path`` (its folder is created); returns the path.  The file is
    replaced whole (written beside it, then renamed): a kill while writing leaves what was there, such
    as the run's stream (``Stream``)."""
    path = Path(path)
    validate(document, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return path


# The fields that name an entry of each list: in a stream, a later line's entry replaces the earlier one
# of the same name.
NAMED_BY = {"results": ("backend", "dtype", "op"), "relations": ("backend", "dtype", "relation"),
            "forward": ("backend", "dtype"), "traces": ("backend", "dtype"), "serving": ("backend", "dtype"),
            "invariance": ("backend", "dtype", "relation"), "op_invariance": ("backend", "dtype", "op"),
            "problems": ("test", "phase", "message"), "deviations": ("backend", "op", "dtype", "reason")}


def _name(section: str, entry: dict) -> tuple:
    return (section, *(json.dumps(entry.get(key)) for key in NAMED_BY[section]))


class Stream:
    """The JSON report while the run goes, so that a run killed at any moment leaves every finished test's
    verdict: JSON lines, the first with the schema, version and environment (and ``"streaming": true``),
    then one per finished test, ``{"test": NODE ID, SECTION: [ENTRY, ...], ...}`` with the entries the
    test changed, each whole.  Each line is flushed when written; a kill can cut only the last one
    short, and ``load`` leaves that one out.  The plugin replaces the stream with the whole document
    (``dump``) when the run ends."""

    def __init__(self, path, env: dict, deviations=()):
        self.path, self.env, self.deviations = Path(path), _jsonable(env), deviations
        self.written: dict[tuple, dict] = {}  # an entry's name -> the entry as last written
        self.file = None

    def update(self, recorder, test: str) -> None:
        """Append ``test``'s line: the entries of ``recorder``'s document that changed since the last line."""
        doc = document(recorder, self.env, self.deviations)
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - open for the run, closed by close()
            header = {"schema": doc["schema"], "version": doc["version"], "environment": doc["environment"],
                      "streaming": True}
            self.file.write(json.dumps(header, allow_nan=False) + "\n")
        line = {"test": test}
        for section in NAMED_BY:
            for entry in doc.get(section, []):
                name = _name(section, entry)
                if self.written.get(name) != entry:
                    self.written[name] = entry
                    line.setdefault(section, []).append(entry)
        self.file.write(json.dumps(line, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _sort_key(section: str):
    ops = list(CONTRACT)

    def key(entry):
        return tuple(dtype_rank(entry[k]) if k == "dtype" else
                     (ops.index(entry[k]) if entry[k] in ops else len(ops), entry[k]) if k == "op" else entry[k]
                     for k in NAMED_BY[section])
    return key


def _streamed(lines: list[str], source: str) -> dict:
    """A stream's document (``Stream``): its entries, each as its last line wrote it, sorted as
    ``document`` sorts them; ``partial`` says that the run stopped before writing the whole."""
    header = json.loads(lines[0])
    doc = {key: value for key, value in header.items() if key != "streaming"}
    doc |= {section: [] for section in NAMED_BY}
    entries, finished = {}, 0
    for number, line in enumerate(lines[1:], 2):
        try:
            update = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the line a kill cut short
                break
            raise ReportError(f"{source}: line {number} of the streamed report is not JSON") from None
        if not isinstance(update, dict):
            raise ReportError(f"{source}: line {number} of the streamed report is not an object")
        finished += 1
        for section in NAMED_BY:
            for entry in update.get(section, []):
                entries[_name(section, entry)] = entry
    for (section, *_), entry in entries.items():
        doc[section].append(entry)
    for section in NAMED_BY:
        if section not in ("problems", "deviations"):  # those two keep the order they came in
            doc[section].sort(key=_sort_key(section))
    doc["partial"] = (f"the run stopped after {finished} finished test{'s' if finished != 1 else ''}, before it "
                      f"wrote its whole report: these are the finished tests' verdicts, as it streamed them")
    return doc


def _check_fields(entry, fields: dict, where: str, source: str) -> None:
    """Raise ``ReportError`` unless ``entry`` has each field that ``fields`` (the schema's) requires, of its kind."""
    if not isinstance(entry, dict):
        raise ReportError(f"{source}: {where} is {type(entry).__name__}, expected an object")
    for key, field in fields.items():
        kind = field.kind
        if kind is None:  # not required
            continue
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
    for key, kind in ((key, field.kind) for key, field in DOCUMENT_FIELDS.items() if field.kind in (dict, list)):
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
    """Read and validate a JSON report written by ``dump``, or the stream a run left (``Stream``: its
    finished tests, the document's ``partial`` saying so); ``ReportError`` names the file otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ReportError(f"{path}: cannot read the report: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not a {SCHEMA} (not UTF-8 text)") from None
    lines = text.splitlines()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if not (lines and _is_stream_header(lines[0])):
            raise ReportError(f"{path}: not a {SCHEMA}: invalid JSON at line {e.lineno} column {e.colno}: "
                              f"{e.msg}") from None
        doc = _streamed(lines, str(path))
    else:
        if isinstance(doc, dict) and doc.get("streaming") is True:  # a stream of its header alone
            doc = _streamed(lines, str(path))
    return validate(doc, str(path))


def _is_stream_header(line: str) -> bool:
    try:
        header = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(header, dict) and header.get("streaming") is True
