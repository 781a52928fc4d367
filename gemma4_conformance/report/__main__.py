"""Render JSON reports as one HTML page.

    gemma4-conformance-report html OUT.html IN.json                 one report
    gemma4-conformance-report merge OUT.html IN1.json IN2.json ...  several (backends, machines, versions) side by side

Each document is labelled by its file's name (``--label`` overrides, once per input, in order); the
labels tell apart a backend that occurs in several reports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import ReportError, load, write_html


def _labels(paths: list[Path]) -> list[str]:
    """File names without .json; where two collide, the parent folder is added."""
    stems = [p.name.removesuffix(".json") for p in paths]
    return [f"{p.parent.name}/{s}" if stems.count(s) > 1 and p.parent.name else s for p, s in zip(paths, stems)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gemma4-conformance-report", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, nargs, help in (("html", 1, "render one JSON report as an HTML page"),
                              ("merge", "+", "merge several JSON reports into one HTML page, side by side")):
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument("out", metavar="OUT.html", type=Path, help="the HTML page to write")
        sub.add_argument("inputs", metavar="IN.json", type=Path, nargs=nargs, help="JSON reports (report.dump)")
        sub.add_argument("--label", action="append", default=None,
                         help="a document's label in the page (once per input, in order; default: its file's name)")
        sub.add_argument("--title", default=None, help="the page's title")
    args = parser.parse_args(argv)
    if args.label is not None and len(args.label) != len(args.inputs):
        parser.error(f"--label given {len(args.label)} times for {len(args.inputs)} inputs")
    try:
        documents = [load(path) for path in args.inputs]
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = write_html(args.out, documents, args.label or _labels(args.inputs), args.title)
    backends = sorted({r["backend"] for d in documents for r in d["results"] + d["forward"]})
    print(f"wrote {out} ({len(documents)} report{'s' if len(documents) != 1 else ''}: {', '.join(backends)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
