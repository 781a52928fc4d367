"""An engine in another language, judged from its trace file: examples/trace_engine/trace_engine.c, built with
the system's C compiler, computes layer 0's first nodes of the generated checkpoint and writes a trace file;
``gemma4-conformance judge`` passes the correct build and locates the planted bug (RoPE on adjacent pairs)
to its node and layer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gemma4_conformance.checkpoints import checkpoint, generate

SOURCE = Path(__file__).resolve().parent.parent / "examples" / "trace_engine" / "trace_engine.c"
COMPUTED = ["embed", "layers.0.input_layernorm", "layers.0.q_proj", "layers.0.q_norm", "layers.0.q_rope"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return checkpoint.load(generate.write_checkpoint(tmp_path_factory.mktemp("c-engine"), generate.small_config()))


def judged(tmp_path, weights, flags: list[str]) -> tuple[int, dict, str]:
    """Build the engine with ``flags``, run it, judge its trace in another process: (exit status, the JSON
    report's trace entry, the judge's output)."""
    compiler = shutil.which("cc")
    assert compiler, "the C example needs the system's C compiler, cc"
    engine = tmp_path / "trace_engine"
    subprocess.run([compiler, "-O2", "-std=c99", "-Wall", "-Werror", *flags, "-o", str(engine), str(SOURCE), "-lm"],
                   check=True)
    config = weights.config
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 24)
    trace = tmp_path / "trace.safetensors"
    subprocess.run([str(engine), str(trace), weights.prefix, repr(config.eps), repr(config.layers[0].rope_theta),
                    ",".join(map(str, tokens)), *map(str, weights.files)], check=True)
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "gemma4_conformance", "judge", str(trace), f"--weights={weights.path}",
                           f"--report-json={report}", "--report-html="], capture_output=True, text=True, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert report.exists(), output
    (entry,) = json.loads(report.read_text())["traces"]
    return done.returncode, entry, output


def test_the_c_engine_passes_every_node_it_computes(tmp_path, weights):
    status, entry, output = judged(tmp_path, weights, [])
    assert status == 0, output
    outcomes = {n["node"]: n["outcome"] for n in entry["nodes"]}
    assert [node for node, outcome in outcomes.items() if outcome == "passed"] == COMPUTED, entry["summary"]
    assert set(outcomes.values()) == {"passed", "not traced"} and entry["backend"] == "c-example (trace.safetensors)"
    assert "its forward is not judged" in output  # a trace without logits says so rather than passing the forward


def test_the_c_engines_planted_rope_bug_is_located_to_its_node_and_layer(tmp_path, weights):
    status, entry, output = judged(tmp_path, weights, ["-DROPE_ADJACENT_PAIRS"])
    assert status == 1, output
    first = entry["first_departure"]
    assert (first["node"], first["op"], first["layer"]) == ("layers.0.q_rope", "rope", 0), entry["summary"]
    failed = [n["node"] for n in entry["nodes"] if n["outcome"] == "failed"]
    assert failed == ["layers.0.q_rope"]  # its inputs, computed right, pass: the bug is in this node alone
