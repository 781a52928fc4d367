"""Where the main job's time goes, and how fast the oracles are: a tool, not a timed test.

    python -m benchmarks.split                           # pytest --backend=torch, default profile
    python -m benchmarks.split --backend=jax --json jax.json
    python -m benchmarks.split --oracles-only            # oracle multiply-adds per second per op
    python -m benchmarks.split --compare before.json after.json
    python -m benchmarks.split -- -k linear              # anything after -- goes to pytest

1. *Oracle throughput*: each accumulating op's oracle (and rope's) on inputs of the real model's
   kind, made larger until one call takes ``--min-seconds``; the rate is counted in the op's own
   unit: multiply-adds for products, squares for norms, exp terms for softmax, coordinates for rope.
   ``--judging-only`` does the same for oracle plus judging, and where the largest input's call takes
   less, times as many calls of it as fill ``--min-seconds``.
2. *The main job's split*: the suite run in this process, exactly as ``pytest --backend=...`` runs
   it, with its wall and CPU time charged to what was running: the oracle, the backend, building
   the inputs, judging (rounding the exact results, error models, comparing), the rest of each
   property test (Hypothesis and the strategies, the relations' own checks), the full forward
   (reference, certification, baseline), the trace's nodes, the serving path, the report, and pytest
   itself.  It also counts, per backend and op, how many output elements the oracle checked out of
   how many the backend made, and the same for the forward's certification and the trace.

It patches only the suite's module attributes (the op table's oracles, the adapter contract's ``call``
where the judging, the relations and the composed graph import it, and ``judging.assess`` and its
imports in forward and trace), so it measures any checkout of the suite since the judge was named
``judging``: run it with ``PYTHONPATH=<other checkout>`` from that checkout's root to compare two
versions back to back.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

ORACLE_CATEGORIES = ("oracle", "judge", "backend", "inputs", "strategies + Hypothesis", "relations",
                     "forward", "trace", "serving", "report", "pytest and startup")
CATEGORY_TITLES = {
    "oracle": "oracle (the ops' exact results)",
    "judge": "judging (rounding, error models, comparing)",
    "backend": "backend under test",
    "inputs": "building the inputs (strategies.build)",
    "strategies + Hypothesis": "strategies and Hypothesis",
    "relations": "relations' own checks and draws",
    "forward": "forward: generation, reference, certification, baseline",
    "trace": "trace: every node's op on the engine's own inputs",
    "serving": "serving: sessions, reference prefills, baselines",
    "report": "report (JSON and HTML)",
    "pytest and startup": "pytest: startup, collection, imports, other",
}


# 1. Oracle throughput ---------------------------------------------------------------------------------

def _values(rng, shape, dtype, scale=1.0):
    from gemma4_conformance.spec import format_of
    return (rng.standard_normal(shape) * scale).astype(format_of(dtype).dtype)


def _linear(K):
    def make(n, dtype, rng):
        return (_values(rng, (n, K), dtype), _values(rng, (2, K), dtype)), 2 * n * K
    return make


def _gate_up(n, dtype, rng):
    return (_values(rng, (n, 3840), dtype), _values(rng, (n, 3840), dtype), _values(rng, (2, 3840), dtype)), 4 * n * 3840


def _lm_head(n, dtype, rng):
    return (1.0, 30.0, _values(rng, (n, 3840), dtype), _values(rng, (2, 3840), dtype)), 2 * n * 3840


def _attention(op, Hkv, G, D, window=None):
    """One query at the last position against L keys: q.k and p.v are 2 D multiply-adds per visible key."""
    def make(L, dtype, rng):
        q = _values(rng, (1, Hkv, G, D), dtype, 2.0**-3)
        k, v = _values(rng, (L, Hkv, D), dtype, 2.0**-3), _values(rng, (L, Hkv, D), dtype)
        visible = min(L, window) if window else L
        work = 2 * Hkv * G * D * visible
        if op == "decode_gqa":
            return (1.0, q[0], k, v), work
        pos = np.array([L - 1])
        return ((1.0, window, pos, q, k, v) if window else (1.0, pos, q, k, v)), work
    return make


def _softmax(n, dtype, rng):
    return (_values(rng, (n, 4096), dtype, 4.0), np.ones((n, 4096), dtype=bool)), n * 4096


def _norm(op):
    def make(n, dtype, rng):
        x = _values(rng, (n, 3840), dtype)
        w, z = _values(rng, (3840,), dtype), _values(rng, (n, 3840), dtype)
        args = {"rms": (1e-6, x), "rmsnorm_unit": (1e-6, x), "l2norm": (1e-6, x), "rmsnorm": (1e-6, x, w),
                "rmsnorm_offset": (1e-6, x, w), "rmsnorm_gated": (1e-6, x, z, w)}[op]
        return args, n * 3840
    return make


def _rope(n, dtype, rng):
    pos = rng.integers(0, 262144, n)
    return (1e4, 256, 256, 128, pos, _values(rng, (n, 256), dtype)), n * 256


def _elementwise(op):
    """An elementwise op on n rows of 4096: its unit is an output element."""
    def make(n, dtype, rng):
        x, y = _values(rng, (n, 4096), dtype, 4.0), _values(rng, (n, 4096), dtype)
        args = {"sigmoid": (x,), "silu": (x,), "gelu_tanh": (x,), "softcap": (30.0, x), "silu_mul": (x,),
                "gelu_mul": (x,), "residual": (0.5, x, y), "sigmoid_gate": (x, y),
                "embed": (2.0, x, rng.integers(0, n, n))}[op]
        return args, n * (2048 if op.endswith("_mul") else 4096)
    return make


# (label, op, make, unit, sizes): sizes grow to the real model's (K = 3840 and 15360, N up to 15360, a
# vocabulary chunk of 16384, 4096 keys at D = 256 with G = 2 and at D = 512 with G = 16).
def _doublings(top):
    return [1 << i for i in range(int(math.log2(top)) + 1)] + ([top] if top & (top - 1) else [])


THROUGHPUT = [
    ("linear K=3840", "linear", _linear(3840), "multiply-adds", _doublings(15360)),
    ("linear K=15360", "linear", _linear(15360), "multiply-adds", _doublings(3840)),
    ("gate_up K=3840", "gate_up", _gate_up, "multiply-adds", _doublings(15360)),
    ("lm_head H=3840", "lm_head", _lm_head, "multiply-adds", _doublings(16384)),
    ("causal_gqa D=512 G=16", "causal_gqa", _attention("causal_gqa", 1, 16, 512), "multiply-adds", _doublings(4096)),
    ("sliding_gqa D=256 G=2", "sliding_gqa", _attention("sliding_gqa", 8, 2, 256, window=1024), "multiply-adds",
     _doublings(4096)),
    ("decode_gqa D=256 G=2", "decode_gqa", _attention("decode_gqa", 8, 2, 256), "multiply-adds", _doublings(4096)),
    ("softmax L=4096", "softmax", _softmax, "exp terms", _doublings(64)),
    *((f"{op} H=3840", op, _norm(op), "squares", _doublings(64))
      for op in ("rms", "rmsnorm", "rmsnorm_offset", "rmsnorm_unit", "rmsnorm_gated", "l2norm")),
    ("rope D=256", "rope", _rope, "coordinates", _doublings(4096)),
]
ELEMENTWISE = [(f"{op} 4096", op, _elementwise(op), "outputs", _doublings(4096))
               for op in ("sigmoid", "silu", "gelu_tanh", "softcap", "silu_mul", "gelu_mul", "residual", "embed",
                          "sigmoid_gate")]


def judging_throughput(dtypes: list[str], min_seconds: float, max_work: float, ops=None) -> list[dict]:
    """Oracle plus judging (judging.assess: the first stage, and the oracle where it cannot decide) of
    the numpy backend's output, per op and dtype (those in ``ops``, or all), grown as
    ``oracle_throughput`` after one untimed call; rates in output elements per CPU second, and in the
    op's own unit."""
    from gemma4_conformance import adapters
    from gemma4_conformance.adapters.contract import call
    from gemma4_conformance.properties.judging import assess

    numpy_backend = adapters.load("numpy")
    rows = []
    for dtype in dtypes:
        print(f"  {dtype}")
        for label, op, make, unit, sizes in THROUGHPUT + ELEMENTWISE:
            if ops is not None and op not in ops:
                continue
            rng = np.random.default_rng(0)
            args, _ = make(sizes[0], dtype, np.random.default_rng(1))  # once untimed: loading compiled code
            assess(op, args, call(numpy_backend, op, args, dtype), dtype, work=10**12)
            for n in sizes:
                args, work = make(n, dtype, rng)
                if work > max_work and n != sizes[0]:
                    break
                out = call(numpy_backend, op, args, dtype)
                start = time.process_time()
                verdict = assess(op, args, out, dtype, work=10**12)
                seconds = max(time.process_time() - start, 1e-9)
                row = {"label": label, "op": op, "dtype": dtype, "size": n, "work": work, "unit": unit,
                       "seconds": seconds, "rate": work / seconds, "outputs": out.size,
                       "elements_rate": out.size / seconds,
                       "by_oracle": getattr(verdict, "by_oracle", verdict.checked) / max(verdict.checked, 1)}
                if seconds >= min_seconds:
                    break
            calls = 1
            while seconds < min_seconds:  # the largest size took less: as many calls as fill min_seconds
                start = time.process_time()
                assess(op, args, out, dtype, work=10**12)
                seconds, calls = seconds + time.process_time() - start, calls + 1
            row.update(seconds=seconds / calls, rate=work * calls / seconds, elements_rate=out.size * calls / seconds)
            rows.append(row)
            print(f"    {label:<24} {row['elements_rate']:>10.3g} outputs/s {row['rate']:>10.3g} {unit}/s   "
                  f"oracle's share {row['by_oracle']:.2%}   ({row['outputs']} outputs in {row['seconds']:.3g} s)",
                  flush=True)
    return rows


def oracle_throughput(dtype: str, min_seconds: float, max_work: float) -> list[dict]:
    """Each op's oracle on ever larger inputs until a call takes ``min_seconds`` (or the real size, or
    ``max_work`` units, is reached); the rate of the last call."""
    from gemma4_conformance import spec

    rows = []
    for label, op, make, unit, sizes in THROUGHPUT:
        rng = np.random.default_rng(0)
        for n in sizes:
            args, work = make(n, dtype, rng)
            if work > max_work and n != sizes[0]:
                break
            start = time.perf_counter()
            spec.ORACLES[op](*args)
            seconds = time.perf_counter() - start
            row = {"label": label, "op": op, "size": n, "work": work, "unit": unit, "seconds": seconds,
                   "rate": work / seconds}
            if seconds >= min_seconds:
                break
        rows.append(row)
        print(f"  {label:<24} {row['rate']:>12.3g} {unit}/s   ({row['work']:.3g} in {row['seconds']:.3g} s)",
              flush=True)
    return rows


# 2. The main job's split ------------------------------------------------------------------------------

class Clock:
    """Wall and CPU time charged to the innermost category running (a category inside another pauses
    it). On a machine shared with other work the wall time stretches; the CPU time much less."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self.cpu: Counter = Counter()
        self.stack: list[str] = []
        self.mark = time.perf_counter(), time.process_time()

    def _charge(self):
        now = time.perf_counter(), time.process_time()
        if self.stack:
            self.seconds[self.stack[-1]] += now[0] - self.mark[0]
            self.cpu[self.stack[-1]] += now[1] - self.mark[1]
        self.mark = now

    @contextlib.contextmanager
    def on(self, category):
        self._charge()
        self.stack.append(category)
        try:
            yield
        finally:
            self._charge()
            self.stack.pop()


def _kind(item) -> str:
    name = getattr(item, "originalname", None) or item.name
    if name == "test_matches_oracle":
        return "agreement"
    if name == "test_relation_holds":
        return "relations"
    if name.startswith("test_trace"):
        return "trace"
    if "serving" in name:
        return "serving"
    if "forward" in name or "reference" in name:
        return "forward"
    return "other"


BASE = {"agreement": "strategies + Hypothesis", "relations": "relations", "forward": "forward", "trace": "trace",
        "serving": "serving", "other": "pytest and startup"}


class Profiler:
    """A pytest plugin that charges the run's time to categories and counts the elements the oracle checks:
    of the agreement tests' examples, of the reference forward's certification and of the trace's node calls,
    each oracle call counted for the assessment that made it."""

    def __init__(self):
        self.clock = Clock()
        self.item = None
        # (backend, dtype, op) -> examples, checked output elements, output elements
        self.coverage = defaultdict(lambda: {"examples": 0, "checked": 0, "outputs": 0, "by_oracle": 0})
        self.certified = {"calls": 0, "checked": 0, "outputs": 0, "by_oracle": 0}
        self.traced = {"calls": 0, "checked": 0, "outputs": 0, "by_oracle": 0}
        self.counting = None  # the record the running assessment's oracle calls count for

    # the current test
    def _params(self):
        return getattr(getattr(self.item, "callspec", None), "params", {}) if self.item is not None else {}

    def _key(self, op):
        params = self._params()
        return params["adapter"].name, params.get("dtype", params.get("forward_dtype", "")), op

    def _phase(self, item):
        self.item = item
        return self.clock.on(BASE[_kind(item)])

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        with self._phase(item):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        with self._phase(item):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item):
        with self._phase(item):
            return (yield)

    # the patches
    def install(self):
        from gemma4_conformance.properties import forward, judging, relations, table

        traced = importlib.util.find_spec("gemma4_conformance.properties.trace")  # absent in older checkouts
        trace = importlib.import_module(traced.name) if traced else None

        for name, entry in list(table.OPS.items()):
            table.OPS[name] = dataclasses.replace(entry, oracle=self._oracle(name, entry.oracle))
        composed = importlib.util.find_spec("gemma4_conformance.composition")  # absent in older checkouts
        graph = importlib.import_module("gemma4_conformance.composition.graph") if composed else None
        for module in (judging, relations, forward, graph):
            if hasattr(module, "call"):
                module.call = self._call(module.call)
        for module in (judging, relations):
            if hasattr(module, "build"):
                module.build = self._timed("inputs", module.build)
        judging.assess = self._assess(judging.assess, certification=False)
        forward.assess = self._assess(forward.assess, certification=True)
        if trace is not None:
            trace.assess = self._assess(trace.assess, certification=False)  # counted as the trace's by _kind

    def _timed(self, category, fn):
        def timed(*args, **kwargs):
            with self.clock.on(category):
                return fn(*args, **kwargs)
        return timed

    def _kind(self):
        return _kind(self.item) if self.item is not None else "other"

    def _oracle(self, op, fn):
        def oracle(*args):
            with self.clock.on("oracle" if self._kind() == "agreement" else BASE[self._kind()]):
                out = fn(*args)
            if self.counting is not None:
                self.counting["by_oracle"] += int(np.size(out))
            return out
        return oracle

    def _call(self, fn):
        def call(adapter, op, args, dtype):
            under_test = self._params().get("adapter") is adapter
            with self.clock.on("backend") if under_test else contextlib.nullcontext():
                return fn(adapter, op, args, dtype)
        return call

    def _assess(self, fn, certification):
        def assess(op, args, out, dtype, *rest, **kwargs):
            kind = self._kind()
            if certification or kind == "trace":
                record = self.certified if certification else self.traced
                record["calls"] += 1
            elif kind == "agreement":
                record = self.coverage[self._key(op)]
                record["examples"] += 1
            else:
                return fn(op, args, out, dtype, *rest, **kwargs)
            record["outputs"] += int(np.size(out))
            previous, self.counting = self.counting, record
            try:
                with self.clock.on("judge") if kind == "agreement" and not certification else contextlib.nullcontext():
                    verdict = fn(op, args, out, dtype, *rest, **kwargs)
                record["checked"] += verdict.checked
                return verdict
            finally:
                self.counting = previous
        return assess

    def pytest_configure(self, config):
        from gemma4_conformance import plugin

        plugin.write_reports = self._timed("report", plugin.write_reports)


def main_job(pytest_args: list[str]) -> dict:
    profiler = Profiler()
    profiler.install()
    wall, cpu = time.perf_counter(), time.process_time()
    status = pytest.main(list(pytest_args), plugins=[profiler])  # pytest adds its addopts to the list
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    wall_split, cpu_split = dict(profiler.clock.seconds), dict(profiler.clock.cpu)
    wall_split["pytest and startup"] = wall_split.get("pytest and startup", 0.0) + wall - sum(wall_split.values())
    cpu_split["pytest and startup"] = cpu_split.get("pytest and startup", 0.0) + cpu - sum(cpu_split.values())
    coverage = [{"backend": b, "dtype": d, "op": op, **v} for (b, d, op), v in sorted(profiler.coverage.items())]
    return {"args": pytest_args, "exit": int(status), "wall": wall, "cpu": cpu, "seconds": wall_split,
            "cpu_seconds": cpu_split, "coverage": coverage, "certified": profiler.certified, "traced": profiler.traced}


def _main_job_in_a_process(where: Path, backend: str, profile: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "job.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--split-only", f"--backend={backend}",
                        f"--profile={profile}", f"--json={out}", "--", *extra],
                       env={**os.environ, "PYTHONPATH": str(where)}, check=False)
        return json.loads(out.read_text())["jobs"][0]


def print_split(result: dict) -> None:
    print(f"\nmain job: pytest {' '.join(result['args'])}: exit {result['exit']}, wall {result['wall']:.1f} s, "
          f"CPU {result['cpu']:.1f} s")
    print(f"  {'':<58} {'wall':>8}   {'share':>6} {'CPU':>8}   {'share':>6}")
    for category in ORACLE_CATEGORIES:
        s, c = result["seconds"].get(category, 0.0), result.get("cpu_seconds", {}).get(category, 0.0)
        print(f"  {CATEGORY_TITLES[category]:<58} {s:>8.1f} s {s / result['wall']:>6.1%} {c:>8.1f} s "
              f"{c / max(result['cpu'], 1e-9):>6.1%}")
    totals = defaultdict(lambda: Counter())
    print("\noutput elements checked, per backend and op (all dtypes), and the share the oracle itself judged:")
    print(f"  {'backend':<8} {'op':<15} {'examples':>8} {'checked':>12} {'of outputs':>12} {'share':>7} {'oracle':>7}")
    per_op = defaultdict(Counter)
    keys = ("examples", "checked", "outputs", "by_oracle")
    for row in result["coverage"]:
        per_op[row["backend"], row["op"]].update({k: row.get(k, 0) for k in keys})
        totals[row["backend"]].update({k: row.get(k, 0) for k in keys})
    for (backend, op), c in [*sorted(per_op.items()), *(((b, "all ops"), c) for b, c in sorted(totals.items()))]:
        print(f"  {backend:<8} {op:<15} {c['examples']:>8} {c['checked']:>12} {c['outputs']:>12} "
              f"{c['checked'] / max(c['outputs'], 1):>7.1%} {c['by_oracle'] / max(c['checked'], 1):>7.1%}")
    for label, c in (("forward certification", result["certified"]), ("trace", result.get("traced"))):
        if c:
            print(f"  {label}: {c['calls']} op calls, {c['checked']} of {c['outputs']} outputs checked "
                  f"({c['checked'] / max(c['outputs'], 1):.1%}), {c.get('by_oracle', 0) / max(c['checked'], 1):.1%} "
                  f"of them by the oracle")


# 3. Before and after ----------------------------------------------------------------------------------

def compare(before_path: str, after_path: str) -> None:
    before, after = json.loads(Path(before_path).read_text()), json.loads(Path(after_path).read_text())
    print(f"before: {before_path} ({before['machine']})\nafter:  {after_path} ({after['machine']})")
    if before.get("oracles") and after.get("oracles"):
        print(f"\noracle throughput ({after['dtype']} inputs)")
        print(f"  {'op':<24} {'unit':<14} {'before /s':>11} {'after /s':>11} {'ratio':>8}")
        previous = {row["label"]: row for row in before["oracles"]}
        for row in after["oracles"]:
            b = previous.get(row["label"])
            if b:
                print(f"  {row['label']:<24} {row['unit']:<14} {b['rate']:>11.3g} {row['rate']:>11.3g} "
                      f"{row['rate'] / b['rate']:>7.0f}x")
    for b, a in zip(before.get("jobs", []), after.get("jobs", [])):
        print(f"\nmain job: pytest {' '.join(a['args'])} (before: exit {b['exit']}, after: exit {a['exit']})")
        print(f"  {'':<64} {'before':>9} {'after':>9} {'ratio':>7}")
        rows = [("wall time (s)", b["wall"], a["wall"]), ("CPU time (s)", b["cpu"], a["cpu"])]
        rows += [(f"{CATEGORY_TITLES[c]}, wall", b["seconds"].get(c, 0.0), a["seconds"].get(c, 0.0))
                 for c in ORACLE_CATEGORIES]
        rows += [(f"{CATEGORY_TITLES[c]}, CPU", b.get("cpu_seconds", {}).get(c, 0.0),
                  a.get("cpu_seconds", {}).get(c, 0.0)) for c in ORACLE_CATEGORIES]
        for label, x, y in rows:
            print(f"  {label:<64} {x:>9.1f} {y:>9.1f} {y / x if x else float('nan'):>7.2f}")
        for label, key in (("examples judged", "examples"), ("output elements checked", "checked"),
                           ("output elements made", "outputs")):
            x, y = (sum(r[key] for r in job["coverage"]) for job in (b, a))
            print(f"  {label:<64} {x:>9} {y:>9} {y / x if x else float('nan'):>7.2f}")
        for label, key in (("forward certification: outputs checked", "certified"), ("trace: outputs checked", "traced")):
            x, y = b.get(key, {}).get("checked", 0), a.get(key, {}).get("checked", 0)
            print(f"  {label:<64} {x:>9} {y:>9} {y / x if x else float('nan'):>7.2f}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="torch", help="comma-separated; each is one main job (default torch)")
    parser.add_argument("--profile", default="default", help="Hypothesis profile of the main job (default: default)")
    parser.add_argument("--dtype", default="float32", help="the inputs' dtype for the oracle throughput")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="grow each oracle's input until a call "
                                                                       "takes this long (default 1)")
    parser.add_argument("--max-work", type=float, default=float("inf"), help="and at most this much work")
    parser.add_argument("--oracles-only", action="store_true")
    parser.add_argument("--judging-only", action="store_true", help="oracle plus judging per op and --dtype "
                                                                     "(comma-separated), in output elements a second")
    parser.add_argument("--ops", help="with --judging-only: these ops only (comma-separated)")
    parser.add_argument("--split-only", action="store_true")
    parser.add_argument("--json", help="write the measurements here (for --compare)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print a before/after table")
    args = parser.parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return 0
    import gemma4_conformance

    where = Path(gemma4_conformance.__file__).resolve().parent.parent
    machine = f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start"
    print(f"suite: {where}; {machine}")
    result = {"suite": str(where), "machine": machine, "dtype": args.dtype, "oracles": [], "jobs": []}
    if args.judging_only:
        print(f"\noracle plus judging ({args.dtype}; each grown until a call takes {args.min_seconds} CPU s)")
        result["judging"] = judging_throughput(args.dtype.split(","), args.min_seconds, args.max_work,
                                               args.ops.split(",") if args.ops else None)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    if not args.split_only:
        print(f"\noracle throughput ({args.dtype} inputs; each grown until a call takes {args.min_seconds} s)")
        result["oracles"] = oracle_throughput(args.dtype, args.min_seconds, args.max_work)
    status = 0
    if not args.oracles_only:
        backends = args.backend.split(",")
        for backend in backends:
            if len(backends) == 1:
                job = main_job([f"--backend={backend}", f"--hypothesis-profile={args.profile}", "-q",
                                "-p", "no:cacheprovider", *extra])
                print_split(job)
            else:  # one process per job, as a user runs them
                job = _main_job_in_a_process(where, backend, args.profile, extra)
            result["jobs"].append(job)
            status = status or job["exit"]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
