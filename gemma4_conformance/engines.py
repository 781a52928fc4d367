"""The real engines' conformance table: every installed engine through the suite, one merged report.

    python -m gemma4_conformance.engines                     every installed engine, ci profile
    python -m gemma4_conformance.engines --engines transformers --profile default
    python -m gemma4_conformance.engines -- -k test_forward  extra pytest arguments after --

Each engine (ENGINES: the built-in backends that wrap a real inference engine, where installed) runs
the whole suite in a subprocess of its own, ops, theorems, forward and trace, with the
known-deviations file the suite ships for it if there is one; its JSON report goes to
``OUT/<engine>.json``, and all of them to one page, ``OUT/engines.html``.  The command prints the
table of verdicts per engine and dtype in Markdown (docs/engines.md's table is this output) and exits 1
if an engine is not conformant, 6 if one broke the contract.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

from gemma4_conformance import report
from gemma4_conformance.adapters import BUILTINS, load
from gemma4_conformance.properties.deviations import shipped
from gemma4_conformance.report.data import dtype_rank, number

# The built-in backends that are real engines (the others compose the suite's own ops).
ENGINES = ("transformers", "transformers-eager", "llama.cpp", "vllm")


def installed() -> list[str]:
    """The engines of ENGINES registered here whose library is installed."""
    return [name for name in ENGINES if name in BUILTINS and importlib.util.find_spec(BUILTINS[name][1])]


def version(engine: str) -> str:
    """The engine's version, as its adapter reports it (``version``), else its library's."""
    adapter = load(engine)
    found = getattr(adapter, "version", None)
    if found:
        return str(found)
    from importlib.metadata import PackageNotFoundError, version as package
    try:
        return package(BUILTINS[engine][1])
    except PackageNotFoundError:
        return "unknown"


def run(engine: str, out: Path, profile: str, extra: list[str]) -> tuple[int, Path]:
    """The suite on one engine in a subprocess; (its exit status, its JSON report)."""
    json_path = out / f"{engine}.json"
    command = [sys.executable, "-m", "pytest", "-p", "gemma4_conformance.plugin", "--pyargs", "gemma4_conformance",
               f"--backend={engine}", f"--hypothesis-profile={profile}", "-p", "no:cacheprovider", "-q",
               f"--report-json={json_path}", "--report-html="]
    name = load(engine).name
    for candidate in (engine, name):
        if candidate in shipped():
            command.append(f"--known-deviations={candidate}")
            break
    command += extra
    print("$ " + shlex.join(command[2:]), flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = done.stdout.strip().splitlines()[-1:] or [""]
    print(f"  exit {done.returncode}: {tail[0]}", flush=True)
    return done.returncode, json_path


def rows(documents: list[dict], versions: dict[str, str]) -> list[dict]:
    """One row per backend and dtype of the documents: ops, theorems, forward, trace and what broke."""
    out = []
    for doc in documents:
        backends = sorted({e["backend"] for key in ("results", "forward", "traces") for e in doc[key]})
        for backend in backends:
            dtypes = sorted({e["dtype"] for key in ("results", "forward", "traces", "relations")
                             for e in doc[key] if e["backend"] == backend}, key=dtype_rank)
            for dtype in dtypes:
                def mine(key):
                    return [e for e in doc[key] if (e["backend"], e["dtype"]) == (backend, dtype)]

                ops = [r for r in mine("results") if r["outcome"] != "unsupported"]
                bad = [r["op"] for r in ops if r["outcome"] in ("failed", "errored")]
                known = [r["op"] for r in ops if r["outcome"] == "known deviation"]
                relations = [r for r in mine("relations") if r["outcome"] != "unsupported"]
                forward, trace = (mine("forward") or [None])[0], (mine("traces") or [None])[0]
                passed = f"{len(ops) - len(bad) - len(known)}/{len(ops)}"
                out.append({
                    "engine": backend, "version": versions.get(backend, ""), "dtype": dtype,
                    "ops": passed + (f", failed: {', '.join(bad)}" if bad else "")
                    + (f", known deviation: {', '.join(known)}" if known else ""),
                    "theorems": f"{sum(r['outcome'] == 'passed' for r in relations)}/{len(relations)}",
                    "forward": _forward(forward), "trace": _trace(trace),
                    "broke": sum(f"{backend}-{dtype}" in p["test"] for p in doc["problems"]),
                })
    return out


def _forward(entry) -> str:
    if entry is None:
        return "not run"
    c, b = number(entry["logits"]["candidate"]), number(entry["logits"]["baseline"])
    ratio = f" (logits {c / b:.2g} x baseline)" if c is not None and b else ""
    return entry["outcome"] + ratio


def _trace(entry) -> str:
    if entry is None:
        return "no trace"
    first = entry["first_departure"]
    judged = sum(n["outcome"] in ("passed", "failed") for n in entry["nodes"])
    if first is None:
        return f"{entry['outcome']}: all {judged} judged nodes"
    return (f"{entry['outcome']}: first {first['node']} ({first['op']}) "
            f"{number(first['error']):.3g} > {number(first['budget']):.3g} ULPs")


def markdown(table: list[dict]) -> str:
    head = ["engine", "version", "dtype", "ops passed", "theorems held", "forward", "trace (per node)", "broke"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        lines.append("| " + " | ".join(str(r[k]) for k in ("engine", "version", "dtype", "ops", "theorems", "forward",
                                                            "trace", "broke")) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m gemma4_conformance.engines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=None, help=f"comma-separated, among {', '.join(ENGINES)} "
                                                        "(default: every installed one)")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile: ci (default), default, thorough")
    parser.add_argument("--out", type=Path, default=Path("reports/engines"), help="folder of the reports")
    args = parser.parse_args(argv)
    engines = args.engines.split(",") if args.engines else installed()
    if not engines:
        print(f"no engine is installed here (engines: {', '.join(ENGINES)}; e.g. "
              f"pip install 'gemma4-conformance[transformers]')", file=sys.stderr)
        return 5
    args.out.mkdir(parents=True, exist_ok=True)
    statuses, documents, versions = {}, {}, {}
    for engine in engines:
        versions[load(engine).name] = version(engine)
        statuses[engine], path = run(engine, args.out, args.profile, extra)
        if path.exists():
            documents[engine] = report.load(path)
    page = report.write_html(args.out / "engines.html", list(documents.values()), labels=list(documents),
                             title="Gemma 4 conformance of real engines")
    print(f"\nmerged report: {page}\n")
    print(markdown(rows(list(documents.values()), versions)))
    missing = [e for e in engines if e not in documents]
    if missing:
        print(f"\nno report from {', '.join(missing)} (see its output above)")
    codes = set(statuses.values())
    return 6 if 6 in codes else 1 if 1 in codes else max(codes)


if __name__ == "__main__":
    sys.exit(main())
