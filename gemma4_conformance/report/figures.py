"""The page's charts: matplotlib figures drawn as inline SVG, small and deterministic."""

from __future__ import annotations

import io
import math
import re

import matplotlib
import numpy as np
from markupsafe import Markup
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .data import number
from .formatting import COLOURS, shown, status

_RC = {
    "svg.fonttype": "none",  # text stays text: small, searchable, no embedded glyph paths
    "svg.hashsalt": "gemma4-conformance",  # deterministic ids
    "font.family": "sans-serif", "font.sans-serif": ["DejaVu Sans"], "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8,
    "xtick.labelsize": 7, "ytick.labelsize": 7, "legend.fontsize": 7,
    "axes.spines.top": False, "axes.spines.right": False, "axes.linewidth": 0.6,
}
_SVG_START = re.compile(r"^.*?(?=<svg\b)", re.DOTALL)
_DROP = re.compile(r"<metadata>.*?</metadata>|<!--.*?-->|\s+xmlns(?::\w+)?=\"[^\"]*\"", re.DOTALL)
_IDS = re.compile(r"(\bid=\"|url\(#|href=\"#)([^\")]+)")
_PATH_DATA = re.compile(r'\bd="([^"]*)"')
_DECIMALS = re.compile(r"(\.\d)\d+")
_NUMBER_ATTR = re.compile(r'\b([xy])="(-?\d+\.\d)\d*"')
_NO_ROTATION = re.compile(r' transform="rotate\(-?0 [^"]*\)"')


def _svg(fig: Figure, prefix: str) -> Markup:
    """The figure as inline SVG: no XML prologue, namespaces or metadata, ids made unique to the page,
    path coordinates to 0.1 pt and indentation dropped (what that saves: docs/measurements.md)."""
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
        # Fixed margins rather than a layout engine, which takes three times as long (docs/measurements.md).
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
