"""The ``gemma4-conformance`` command.

    gemma4-conformance judge TRACE... --weights=CKPT [--report-json=F] [--report-html=F]
                             [--known-deviations=F] [-n N] [PYTEST OPTIONS]

``judge`` judges trace files recorded anywhere (docs/trace-file.md): it runs pytest with the suite's
plugin and ``--judge-traces``, so the verdicts, the JSON and HTML reports, the known deviations and the
exit status are exactly a pytest run's (0 conformant, 1 not, 4 a usage error, 6 a broken file).
Options it does not know go to pytest (``-q``, ``-x``, ``--hypothesis-profile=ci``, ...).
"""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 4  # the plugin's and pytest's usage error


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="gemma4-conformance", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    judge = commands.add_parser("judge", help="judge recorded trace files against a checkpoint",
                                description="judge recorded trace files: each node as the trace test does, "
                                            "the logits (and layer outputs) as the forward test does")
    judge.add_argument("traces", nargs="+", metavar="TRACE", help="trace files, or folders of *.safetensors")
    judge.add_argument("--weights", required=True, help="the checkpoint folder the traces were recorded on")
    judge.add_argument("--report-json", default=None, help="write the JSON report here")
    judge.add_argument("--report-html", default="reports/conformance.html",
                       help="write the HTML report here (default reports/conformance.html; '' for none)")
    judge.add_argument("--known-deviations", action="append", default=[], metavar="FILE",
                       help="an engine's accepted deviations (the plugin's option); repeat for several")
    judge.add_argument("-n", dest="workers", default=None, help="pytest-xdist workers (a number or auto)")
    args, pytest_args = parser.parse_known_args(argv)

    import pytest

    # -ra: the summary says what was not judged (a file without logits skips its forward) and why
    command = ["-ra", "-p", "gemma4_conformance.plugin", "--pyargs", "gemma4_conformance.properties.test_recorded",
               f"--weights={args.weights}", f"--report-html={args.report_html}",
               *(f"--judge-traces={path}" for path in args.traces),
               *(f"--known-deviations={path}" for path in args.known_deviations)]
    if args.report_json is not None:
        command.append(f"--report-json={args.report_json}")
    if args.workers is not None:
        command += ["-n", args.workers]
    return int(pytest.main(command + pytest_args))


if __name__ == "__main__":
    sys.exit(main())
