"""Conformance reports: a run's results as a versioned JSON document, and as one self-contained HTML page.

    doc = report.document(recorder, report.environment())   # the document (schema: report/schema.py)
    report.dump(doc, "reports/torch.json")                   # JSON, read back by report.load()
    report.Stream("reports/torch.json", env).update(recorder, test)  # as the run goes: a line per test
    report.write_html("reports/conformance.html", [doc])      # the page; several documents side by side

    gemma4-conformance-report html OUT.html IN.json      (or python -m gemma4_conformance.report)
    gemma4-conformance-report merge OUT.html IN1.json IN2.json ...

The HTML half imports matplotlib and jinja2, so it is loaded only when a page is written.
"""

from __future__ import annotations

from pathlib import Path

from .data import (
    ReportError,
    Stream,
    device_line,
    document,
    dump,
    environment,
    load,
    number,
    validate,
)
from .schema import SCHEMA, VERSION

__all__ = ["SCHEMA", "VERSION", "ReportError", "Stream", "device_line", "document", "dump", "environment", "load", "number", "render",
           "validate", "write_html"]


def render(documents: list[dict], labels: list[str] | None = None, title: str | None = None) -> str:
    """One self-contained HTML page of ``documents`` side by side (see report.html.render)."""
    from .html import render as _render
    return _render(documents, labels, title)


def write_html(path, documents: list[dict], labels: list[str] | None = None, title: str | None = None) -> Path:
    """Write the HTML page of ``documents`` to ``path`` (its folder is created); returns the path."""
    from .html import write
    return write(path, documents, labels, title)

