"""A run recorded in one process (``--record-traces``) and judged in another (``gemma4-conformance judge``)
gets the verdicts the in-process trace and forward tests gave it, node for node; known deviations and
xdist workers apply to judged files as to any run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemma4_conformance import tracefile
from gemma4_conformance.checkpoints import generate

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

LAYERS = 12  # the trace tests' cut of the generated model (tests/trace_engines.py): every feature, fewer nodes


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = generate.small_config()
    config.update(num_hidden_layers=LAYERS, layer_types=config["layer_types"][:LAYERS])
    return generate.write_checkpoint(tmp_path_factory.mktemp("judge"), config)


def pytest_run(cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "gemma4_conformance.plugin", "-p", "no:cacheprovider",
                           "--report-html=", *args], capture_output=True, text=True, cwd=cwd, env=ENV)


def judge(cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gemma4_conformance", "judge", "--report-html=", *args],
                          capture_output=True, text=True, cwd=cwd, env=ENV)


def recorded_in_process(tmp_path, folder, backend: str, dtype: str):
    """The trace and forward tests of ``backend`` in ``dtype``, recording its trace file: (exit status, JSON
    report, the file)."""
    done = pytest_run(tmp_path, "--pyargs", "gemma4_conformance.properties.test_forward", f"--backend={backend}",
                      f"--dtype={dtype}", f"--weights={folder}", f"--record-traces={tmp_path / 'traces'}",
                      f"--report-json={tmp_path / 'in-process.json'}",
                      "-k", "test_trace_nodes_match_their_ops or test_forward_matches_reference")
    assert (tmp_path / "in-process.json").exists(), done.stdout + done.stderr
    (trace,) = (tmp_path / "traces").iterdir()
    return done.returncode, json.loads((tmp_path / "in-process.json").read_text()), trace


def same_verdicts(here: dict, there: dict) -> None:
    """The per-node verdicts and the forward verdict of two reports, compared field by field (the label
    and the rerun command say where each came from, and differ)."""
    (a,), (b,) = here["traces"], there["traces"]
    assert [(n["node"], n["outcome"], n["error"], n["budget"]) for n in a["nodes"]] == \
        [(n["node"], n["outcome"], n["error"], n["budget"]) for n in b["nodes"]]
    assert (a["summary"], a["failures"], a["outcome"]) == (b["summary"], b["failures"], b["outcome"])
    (a,), (b,) = here["forward"], there["forward"]
    fields = ("outcome", "layers", "logits", "top1_agreement", "logprob_gap", "local", "failures")
    assert {k: a[k] for k in fields} == {k: b[k] for k in fields}


def test_a_transformers_trace_judged_in_another_process_gets_the_in_process_verdicts(tmp_path, folder):
    pytest.importorskip("transformers")
    status, here, trace = recorded_in_process(tmp_path, folder, "transformers", "bfloat16")
    assert trace.name == "transformers-sdpa-bfloat16.safetensors"
    done = judge(tmp_path, str(trace), f"--weights={folder}", f"--report-json={tmp_path / 'judged.json'}")
    there = json.loads((tmp_path / "judged.json").read_text())
    assert done.returncode == status == 0, done.stdout[-3000:]
    assert len(here["traces"][0]["nodes"]) > 200 and here["forward"][0]["local"] is not None  # all of it judged
    same_verdicts(here, there)


def test_a_failing_run_fails_alike_and_a_known_deviation_excuses_it_by_the_engines_name(tmp_path, folder):
    """The mutant engine with RoPE on interleaved pairs fails node and forward alike in both processes; a
    known-deviations entry for its engine name turns the judged failure into an excused one (exit 0)."""
    status, here, trace = recorded_in_process(tmp_path, folder, "tests.mutants:ADAPTERS.rope_pairs_interleaved",
                                              "bfloat16")
    assert status == 1 and here["traces"][0]["outcome"] == "failed"
    done = judge(tmp_path, str(trace), f"--weights={folder}", f"--report-json={tmp_path / 'judged.json'}")
    assert done.returncode == 1, done.stdout[-3000:]
    same_verdicts(here, json.loads((tmp_path / "judged.json").read_text()))
    engine = here["traces"][0]["backend"]
    (tmp_path / "accepted.yaml").write_text(f"backend: {engine}\ndeviations:\n"
                                            f"  - {{op: trace, dtype: bfloat16, reason: pairs tracked upstream}}\n")
    done = judge(tmp_path, str(trace), f"--weights={folder}", f"--known-deviations={tmp_path / 'accepted.yaml'}",
                 f"--report-json={tmp_path / 'excused.json'}", "-k", "nodes")
    assert done.returncode == 0, done.stdout[-3000:]
    (entry,) = json.loads((tmp_path / "excused.json").read_text())["traces"]
    assert entry["outcome"] == "known deviation" and entry["deviation"] == "pairs tracked upstream"


def test_many_files_spread_over_xdist_workers_into_one_report(tmp_path, folder):
    """Two recorded files judged with -n 2: one report holds both, each file's verdict under its own label."""
    _, _, trace = recorded_in_process(tmp_path, folder, "numpy", "bfloat16")
    copy = tmp_path / "traces" / "again.safetensors"
    copy.write_bytes(trace.read_bytes())
    done = judge(tmp_path, str(tmp_path / "traces"), f"--weights={folder}", f"--report-json={tmp_path / 'n2.json'}",
                 "-n", "2", "-k", "nodes")
    assert done.returncode == 0, done.stdout[-3000:]
    doc = json.loads((tmp_path / "n2.json").read_text())
    assert sorted(t["backend"] for t in doc["traces"]) == ["numpy (again.safetensors)",
                                                          "numpy (numpy-bfloat16.safetensors)"]
    assert "2 workers" in done.stdout


def test_usage_errors_exit_4_and_say_what_is_wrong(tmp_path, folder):
    missing = tmp_path / "nowhere.safetensors"
    done = judge(tmp_path, str(missing), f"--weights={folder}")
    assert done.returncode == 4 and f"{missing} is neither a file nor a folder" in done.stderr + done.stdout
    done = judge(tmp_path, str(missing))
    assert done.returncode == 4 and "--weights" in done.stderr
    done = pytest_run(tmp_path, "--pyargs", "gemma4_conformance", f"--judge-traces={tmp_path}")
    assert done.returncode == 4 and "--judge-traces needs --weights" in done.stderr + done.stdout


def test_a_file_that_is_no_trace_file_is_one_line_and_exit_6(tmp_path, folder):
    """Each file that cannot be read is named once, with what is wrong, and nothing of the suite's code."""
    garbage, short = tmp_path / "garbage.safetensors", tmp_path / "short.safetensors"
    garbage.write_bytes(bytes(range(256)) * 8)
    short.write_text("hello\n")
    done = judge(tmp_path, str(garbage), str(short), f"--weights={folder}", f"--report-json={tmp_path / 'r.json'}")
    out = done.stdout + done.stderr
    assert done.returncode == 6, out[-3000:]
    for path in (garbage, short):
        [line] = [line for line in out.splitlines() if str(path) in line]
        assert line.startswith(f"trace file (read): {path}: "), out
    assert "Traceback" not in out and "test_recorded.py" not in out and "def " not in out, out
    problems = json.loads((tmp_path / "r.json").read_text())["problems"]
    assert [p["message"].split(":")[0] for p in problems] == [str(garbage), str(short)]


def test_a_declaring_engines_file_is_judged_with_its_declared_formats(tmp_path, folder):
    """The file of an engine that declares its activations q8_0 carries them (metadata ``formats``) and is
    judged with them, as in process: conformant; the same file without them departs at the first product,
    and with a format the suite does not know it is a broken file (exit 6) naming the key."""
    status, here, trace = recorded_in_process(tmp_path, folder, "tests.quantized_engines:DECLARED", "float32")
    found = tracefile.read(trace)
    assert status == 0 and found.metadata["formats"] == "activations=q8_0"
    done = judge(tmp_path, str(trace), f"--weights={folder}", f"--report-json={tmp_path / 'judged.json'}")
    assert done.returncode == 0, done.stdout[-3000:]
    same_verdicts(here, json.loads((tmp_path / "judged.json").read_text()))
    nodes = {k: v for k, v in found.tensors.items() if k not in (tracefile.TOKENS, tracefile.POSITIONS)}
    meta = {k: found.metadata[k] for k in ("engine", "dtype", "checkpoint")}
    for name, formats in (("undeclared", None), ("unknown", {"activations": "q9_9"})):
        tracefile.write(tmp_path / f"{name}.safetensors", tokens=found.tensors[tracefile.TOKENS], nodes=nodes,
                        formats=formats, **meta)
    done = judge(tmp_path, str(tmp_path / "undeclared.safetensors"), f"--weights={folder}", "-k", "nodes")
    assert done.returncode == 1 and "layers.0.q_proj" in done.stdout, done.stdout[-3000:]
    done = judge(tmp_path, str(tmp_path / "unknown.safetensors"), f"--weights={folder}", "-k", "nodes")
    assert done.returncode == 6 and "metadata 'formats' gives activations='q9_9'" in done.stdout + done.stderr, \
        done.stdout[-3000:]
