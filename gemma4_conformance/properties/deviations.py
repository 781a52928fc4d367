"""Known deviations: failures a backend's authors have looked at and accepted, one YAML file per backend.

    # conformance/deviations.yaml, passed as --known-deviations=conformance/deviations.yaml
    backend: myengine            # the --backend spec or the adapter's name
    deviations:
      - op: rope                 # an op, a relation (properties/relations.py), "forward", "trace", "serving"
                                 # or an invariance claim: "invariance:run", "invariance:batch", "invariance:chunk"
        dtype: float16
        reason: fp16 RoPE angles; tracked in myengine#123

The suite ships the known deviations it has measured and explained for real engines in
``gemma4_conformance/deviations/NAME.yaml``; ``--known-deviations=NAME`` (a value that is not a file)
passes that one, so an engine's CI takes the suite's explained findings by name.

A matching test still runs and is reported with its error; if it fails beyond its budget it is an
expected failure (the report shows it as a known deviation, with the reason) and does not fail the
run. An adapter that raises or breaks the contract is never excused. An entry that matches no test
of the run, or whose tests all passed, is warned about, so the file cannot silently go stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from gemma4_conformance.adapters import DTYPES, INVARIANCE
from gemma4_conformance.spec import OP_NAMES

from .relations import RELATIONS

FORWARD = "forward"
SHIPPED = Path(__file__).resolve().parent.parent / "deviations"  # NAME.yaml: measured and explained in docs/engines.md
TRACE = "trace"  # the per-node verdicts of a forward's trace (properties/trace.py)
SERVING = "serving"  # the serving test's verdict (properties/test_serving.py)
CLAIMS = tuple(f"invariance:{r}" for r in INVARIANCE)  # an invariance claim (properties/test_invariance.py)


class DeviationsError(ValueError):
    """A known-deviations file that cannot be used; the message names the file and the entry."""


@dataclass
class Deviation:
    backend: str
    op: str
    dtype: str
    reason: str
    file: str
    matched: list[str] = field(default_factory=list)  # node ids of the tests it covers
    excused: list[str] = field(default_factory=list)  # those that failed and were excused
    passed: list[str] = field(default_factory=list)  # those that passed

    @property
    def status(self) -> str:
        """unmatched (covers no test), excused (a covered test failed and was excused), conforms (every
        covered test passed), or not judged (they were skipped, or broke: neither says it deviates)."""
        if not self.matched:
            return "unmatched"
        if self.excused:
            return "excused"
        return "conforms" if len(self.passed) == len(self.matched) else "not judged"


def subject(item) -> tuple[str, str, str, str] | None:
    """(backend spec, adapter name, dtype, op/relation/"forward"/"trace"/"serving"/CLAIMS) of a suite test, None for others;
    for a recorded run judged from its file, (engine, its label in the report, dtype, "trace"/"forward")."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name, what in (("trace_file", TRACE), ("forward_file", FORWARD)):
        if name in params:  # a recorded run judged from its file (judge.py): its engine is the backend
            recorded = params[name]
            return recorded.engine, recorded.label, recorded.dtype, what
    if "adapter" not in params:
        return None
    if "op" in params:
        what, dtype = params["op"], params["dtype"]
    elif "relation" in params:
        what, dtype = params["relation"], params["dtype"]
    elif "forward_dtype" in params:
        what, dtype = FORWARD, params["forward_dtype"]
    elif "trace_dtype" in params:
        what, dtype = TRACE, params["trace_dtype"]
    elif "serving_dtype" in params:
        what, dtype = SERVING, params["serving_dtype"]
    elif "invariance" in params:
        what, dtype = f"invariance:{params['invariance']}", params["invariance_dtype"]
    else:
        return None
    return params["backend"], params["adapter"].name, dtype, what


class Deviations:
    def __init__(self, entries: list[Deviation]):
        self.entries = entries

    @classmethod
    def load(cls, paths: list[str]) -> Deviations:
        return cls([entry for path in paths for entry in _read(_located(path))])

    def entry_for(self, item) -> Deviation | None:
        found = subject(item)
        if found is None:
            return None
        spec, name, dtype, what = found
        for entry in self.entries:
            if entry.backend in (spec, name) and entry.op == what and entry.dtype == dtype:
                return entry
        return None

    def mark(self, items) -> None:
        """Mark each covered test as a non-strict expected failure: only a failure beyond the budget
        (pytest.fail) is excused, never an exception from the adapter or the suite."""
        for item in items:
            entry = self.entry_for(item)
            if entry is not None:
                entry.matched.append(item.nodeid)
                item.add_marker(pytest.mark.xfail(reason=f"known deviation: {entry.reason}",
                                                  raises=pytest.fail.Exception, strict=False))

    def summary(self) -> list[str]:
        lines = []
        for e in self.entries:
            where = f"{e.backend} {e.dtype} {e.op} ({e.file})"
            if e.status == "unmatched":
                lines.append(f"warning: {where} matches no test of this run; remove it, or check its "
                             f"backend, op and dtype")
            elif e.status == "conforms":
                lines.append(f"warning: {where} passed in all {len(e.matched)} test(s); it may no longer "
                             f"deviate; remove it")
            elif e.status == "not judged":
                lines.append(f"warning: {where}: its tests were skipped or broke, so it was not judged")
            else:
                lines.append(f"excused: {where}: {e.reason}")
        return lines


def shipped() -> list[str]:
    """The names of the known-deviations files the suite ships."""
    return sorted(p.stem for p in SHIPPED.glob("*.yaml"))


def _located(value: str) -> Path:
    """A known-deviations file: the path given, or the shipped file of that name."""
    path = Path(value)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in value:
        return path
    if (SHIPPED / f"{value}.yaml").is_file():
        return SHIPPED / f"{value}.yaml"
    raise DeviationsError(f"{value}: neither a file nor a known-deviations file shipped with the suite "
                          f"(shipped: {', '.join(shipped()) or 'none'})")


def _read(path: Path) -> list[Deviation]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DeviationsError(f"{path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise DeviationsError(f"{path}: not UTF-8 text (byte {e.start}): expected YAML") from None
    except yaml.YAMLError as e:
        raise DeviationsError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("backend"), str) or not data["backend"]:
        raise DeviationsError(f"{path}: expected a mapping with 'backend' (a name) and 'deviations' (a list)")
    items = data.get("deviations") or []
    if not isinstance(items, list):
        raise DeviationsError(f"{path}: 'deviations' must be a list of entries with op, dtype and reason")
    known = {*OP_NAMES, *RELATIONS, FORWARD, TRACE, SERVING, *CLAIMS}
    entries = []
    for i, item in enumerate(items):
        where = f"{path}: deviations[{i}]"
        if not isinstance(item, dict):
            raise DeviationsError(f"{where} is not a mapping with op, dtype and reason")
        missing = [k for k in ("op", "dtype", "reason") if not isinstance(item.get(k), str) or not item[k].strip()]
        if missing:
            raise DeviationsError(f"{where} lacks {', '.join(missing)} (each a non-empty string)")
        extra = sorted(set(item) - {"op", "dtype", "reason"})
        if extra:
            raise DeviationsError(f"{where} has unknown field(s) {', '.join(extra)}")
        if item["op"] not in known:
            raise DeviationsError(f"{where}: op {item['op']!r} is neither an op, a relation, 'forward', 'trace', "
                                  f"'serving' nor an invariance claim ({', '.join(CLAIMS)})")
        if item["dtype"] not in DTYPES:
            raise DeviationsError(f"{where}: dtype {item['dtype']!r} is not one of {', '.join(DTYPES)}")
        entries.append(Deviation(data["backend"], item["op"], item["dtype"], item["reason"].strip(), str(path)))
    return entries
