"""The package's layers point down only: spec -> checkpoints -> adapters -> composition -> judging ->
run state and report -> plugin.  Every import is read from the source, those inside functions too, so
no arrow can point up, and no import can hide in a function to dodge a loop."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gemma4_conformance

PACKAGE = Path(gemma4_conformance.__file__).parent
ROOT = "gemma4_conformance"

# The layers, lowest first: a module may import its own layer and those below it.
LAYERS = (
    ("spec", ("spec",)),
    ("checkpoints", ("checkpoints", "tracefile")),  # the files the suite reads: configs, weights, traces
    ("adapters", ("adapters",)),
    ("composition", ("composition",)),
    ("judging", ("properties",)),
    ("run state and report", ("report",)),
    ("plugin", ("plugin", "judge", "engines", "__main__", "properties.test_", "")),
)


def layer(module: str) -> int:
    """The layer of ``gemma4_conformance.<module>``: the longest prefix listed wins."""
    name = module.removeprefix(ROOT).removeprefix(".")
    best, length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = (name == prefix or name.startswith(prefix + ".") or
                       (prefix.endswith("_") and name.startswith(prefix)))
            if matches and len(prefix) > length:
                best, length = index, len(prefix)
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module imported) for every import of the package in ``source``, relative ones resolved;
    ``from a import b`` counts as importing ``a.b`` where that is a module of the package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == ROOT]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != ROOT:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append((node.lineno, sub if _exists(sub) else target))
    return found


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def upward(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of ``source`` (as ``module``) that point to a higher layer."""
    own = layer(module)
    return [f"{module}:{line} imports {target} ({LAYERS[layer(target)][0]}, above {LAYERS[own][0]})"
            for line, target in imports(source, module, is_package) if layer(target) > own]


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, module_name(path)


def test_no_import_points_up():
    found = []
    for path, module in modules():
        found += upward(path.read_text(), module, path.name == "__init__.py")
    assert not found, "\n".join(found)


def test_every_module_has_a_layer():
    assert all(layer(module) is not None for _, module in modules())
    assert layer("gemma4_conformance.properties.test_serving") == len(LAYERS) - 1
    assert layer("gemma4_conformance.properties.serving") == 4


def test_an_import_that_points_up_is_named():
    source = "def f():\n    from gemma4_conformance.properties.forward import reference\n"
    assert upward(source, "gemma4_conformance.adapters.numpy_backend") == [
        "gemma4_conformance.adapters.numpy_backend:2 imports gemma4_conformance.properties.forward "
        "(judging, above adapters)"]
    assert upward("from ..properties import table\n", "gemma4_conformance.composition.session") == [
        "gemma4_conformance.composition.session:1 imports gemma4_conformance.properties.table "
        "(judging, above composition)"]
    assert upward("from . import graph\nfrom gemma4_conformance.spec import model\n",
                  "gemma4_conformance.composition.session") == []


def test_a_composed_serving_session_loads_no_judging():
    """Serving an adapter's ops needs the graph, the contract and a cache: no strategy, op table,
    budget or Hypothesis."""
    code = ("import sys\n"
            "from gemma4_conformance.adapters import numpy_backend\n"
            "from gemma4_conformance.checkpoints import checkpoint, generate\n"
            "from gemma4_conformance.composition.session import open_session\n"
            "import tempfile, numpy as np\n"
            "path = generate.write_checkpoint(tempfile.mkdtemp(), generate.small_config())\n"
            "weights = checkpoint.load(path)\n"
            "s = open_session(numpy_backend, weights, weights.config.raw, 'float32')\n"
            "out = s.step({0: np.array([2, 5, 7])})\n"
            "assert out[0].shape == (3, weights.config.vocab_size), out[0].shape\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('hypothesis', 'gemma4_conformance.properties')))\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
