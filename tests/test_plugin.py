"""The plugin as a CI gate: exit codes, known deviations, rerun commands, and the report of a broken run.

Each run is the suite in a subprocess on a few ops in float32 with the short `ci` profile, the
plugin asked for by name (as in an engine's repository) from a folder outside this checkout.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemma4_conformance import report
from gemma4_conformance.plugin import (
    EXIT_BROKEN,
    EXIT_CONFORMANT,
    EXIT_NOT_CONFORMANT,
    clipped,
    is_broken,
)
from gemma4_conformance.properties.deviations import Deviations, DeviationsError
from gemma4_conformance.properties.relations import RELATIONS

ROOT = Path(__file__).resolve().parent.parent
EPS_MISSING = "tests.mutants:ADAPTERS.rms_eps_missing"  # fails rms beyond budget in float32
SELECT = "test_matches_oracle and (-rms] or -sigmoid])"


def suite(tmp_path, *args, deviations: str | None = None):
    """Run the suite in ``tmp_path``; returns (exit status, output, the JSON report or None)."""
    command = [sys.executable, "-m", "pytest", "-p", "gemma4_conformance.plugin", "--pyargs", "gemma4_conformance",
               "--dtype=float32", "--hypothesis-profile=ci", "-p", "no:cacheprovider",
               f"--report-json={tmp_path / 'report.json'}", f"--report-html={tmp_path / 'report.html'}", *args]
    if deviations is not None:
        (tmp_path / "deviations.yaml").write_text(deviations)
        command.append(f"--known-deviations={tmp_path / 'deviations.yaml'}")
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    path = tmp_path / "report.json"
    return done.returncode, done.stdout + done.stderr, json.loads(path.read_text()) if path.exists() else None


def rerun_elsewhere(tmp_path, rerun: str) -> subprocess.CompletedProcess:
    """Run a report's rerun command from a folder of its own, as a reader who copied it would."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", *shlex.split(rerun), "-p", "no:cacheprovider", "--report-html="],
                          cwd=elsewhere, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def outcomes(doc) -> dict:
    return {r["op"]: r["outcome"] for r in doc["results"]}


def test_a_conformant_backend_exits_0(tmp_path):
    status, out, doc = suite(tmp_path, "--backend=numpy", "-k", SELECT)
    assert status == EXIT_CONFORMANT, out[-3000:]
    assert outcomes(doc)["rms"] == outcomes(doc)["sigmoid"] == "passed" and not doc["problems"]


def test_a_result_beyond_budget_exits_1_and_the_reports_rerun_command_reproduces_it_anywhere(tmp_path):
    status, out, doc = suite(tmp_path, f"--backend={EPS_MISSING}", "-k", SELECT)
    assert status == EXIT_NOT_CONFORMANT, out[-3000:]
    assert outcomes(doc)["rms"] == "failed" and outcomes(doc)["sigmoid"] == "passed"
    rms = next(r for r in doc["results"] if r["op"] == "rms")
    # The message, the error and the rerun command all describe the worst example, not the shrunk one.
    assert rms["message"].startswith(f"error {rms['worst_ulps']:.4g} ULPs at the op's scale")
    assert "np.float" not in rms["message"] and re.search(r"got -?[0-9]", rms["message"]), rms["message"]  # plain numbers
    rerun = rms["rerun"]
    assert re.search(r"rerun: pytest -p gemma4_conformance.plugin --pyargs .*-rms\]", out)  # the minimal case
    done = rerun_elsewhere(tmp_path, rerun)
    assert done.returncode == EXIT_NOT_CONFORMANT and "1 failed" in done.stdout, done.stdout[-3000:]


def test_a_kernel_that_refuses_gemmas_global_head_dimension_is_unsupported_in_one_line_not_broken(tmp_path):
    """jax-sdpa[implementation=cudnn] states cuDNN's head-dimension limit: Gemma 4's global layers (512)
    make the attention ops unsupported, said in one line each, apart from an adapter that crashes."""
    status, out, doc = suite(tmp_path, "--backend=tests.cudnn_on_cpu:ADAPTER", "--dtype=bfloat16", "-k",
                             "test_matches_oracle and (-decode_gqa] or -sigmoid])")
    assert status == EXIT_CONFORMANT and not doc["problems"], out[-3000:]
    assert outcomes(doc) == {"decode_gqa": "unsupported", "sigmoid": "passed"}
    [refused] = [r for r in doc["results"] if r["op"] == "decode_gqa"]
    line = ("cannot run Gemma 4's global attention (head dimension 512): jax-sdpa-implementation-cudnn.decode_gqa "
            "in bfloat16: cuDNN's fused attention takes head dimensions up to 256 that are multiples of 8, not 512")
    assert refused["message"] == line and "decode_gqa]" in refused["rerun"]
    assert [row for row in out.splitlines() if "decode_gqa" in row and "unsupported" in row] == [
        f"jax-sdpa-implementation-cudnn bfloat16  decode_gqa      unsupported     {line}"], out[-3000:]


def test_a_run_killed_part_way_leaves_a_report_of_every_test_it_finished(tmp_path):
    """The JSON report streams (report.Stream): kill -9 once two tests have finished, and it holds both
    (and nothing of the test under way), readable by report.load and by gemma4-conformance-report merge."""
    report_json = tmp_path / "report.json"
    command = [sys.executable, "-m", "pytest", "-p", "gemma4_conformance.plugin", "--pyargs", "gemma4_conformance",
               "--backend=numpy", "--dtype=float32", "--hypothesis-profile=ci", "-p", "no:cacheprovider",
               f"--report-json={report_json}", "--report-html=", "-v",
               "-k", "test_matches_oracle and (-rms] or -sigmoid] or -silu] or -softmax] or -linear] or -l2norm])"]
    run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 300
    while not (report_json.exists() and report_json.read_text().count("\n") >= 3) and run.poll() is None:
        assert time.monotonic() < deadline  # a header line, then one per finished test: kill after two
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    out, _ = run.communicate()
    assert run.returncode == -signal.SIGKILL, out[-3000:]
    passed = re.findall(r"test_matches_oracle\[numpy-float32-(\w+)\] PASSED", out)  # pytest -v, in run order
    finished = report_json.read_text().count("\n") - 1  # whole lines past the header (pytest -v prints first)
    doc = report.load(report_json)
    assert f"after {finished} finished tests" in doc["partial"] and len(passed) >= finished >= 2
    assert {r["op"]: r["outcome"] for r in doc["results"]} == dict.fromkeys(passed[:finished], "passed")
    merged = subprocess.run([sys.executable, "-m", "gemma4_conformance.report", "merge", str(tmp_path / "m.html"),
                             str(report_json)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert merged.returncode == 0 and (tmp_path / "m.html").exists(), merged.stderr


def test_a_wrong_forward_exits_1_and_its_rerun_command_reproduces_it(tmp_path):
    backend = "tests.forward_mutants:ADAPTERS.final_softcap_missing"
    status, out, doc = suite(tmp_path, f"--backend={backend}", "-k", "test_forward_matches_reference")
    assert status == EXIT_NOT_CONFORMANT, out[-3000:]
    [forward] = doc["forward"]
    assert forward["outcome"] == "failed" and forward["rerun"] in out
    done = rerun_elsewhere(tmp_path, forward["rerun"])
    assert done.returncode == EXIT_NOT_CONFORMANT and "1 failed" in done.stdout, done.stdout[-3000:]


def test_a_nan_found_by_a_drawn_example_is_an_ordinary_failure_with_its_rerun_command(tmp_path):
    """Its error is infinite, which Hypothesis refuses as a search target: the NaN's failure stands."""
    backend = "tests.faulty:ADAPTERS.decode_gqa_nan_for_short_caches"
    status, out, doc = suite(tmp_path, f"--backend={backend}", "--dtype=bfloat16", "-k", "test_matches_oracle and -decode_gqa]")
    assert status == EXIT_NOT_CONFORMANT and "InvalidArgument" not in out, out[-3000:]
    [result] = doc["results"]
    assert result["outcome"] == "failed" and not doc["problems"], result
    assert result["message"].startswith("NaN in the output") and result["worst_ulps"] == "inf", result
    done = rerun_elsewhere(tmp_path, result["rerun"])
    assert done.returncode == EXIT_NOT_CONFORMANT and "NaN in the output" in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize("adapter, evidence", [("sigmoid_raises", "raised RuntimeError: kernel not compiled"),
                                               ("sigmoid_returns_float64", "returned dtype float64")])
def test_a_broken_adapter_exits_6_and_the_other_ops_are_still_reported(tmp_path, adapter, evidence):
    status, out, doc = suite(tmp_path, f"--backend=tests.faulty:ADAPTERS.{adapter}", "-k", SELECT)
    assert status == EXIT_BROKEN, out[-3000:]
    assert outcomes(doc)["sigmoid"] == "errored" and outcomes(doc)["rms"] == "passed"
    assert [p["phase"] for p in doc["problems"]] == ["call"] and evidence in doc["problems"][0]["message"]
    assert "conformance exit status 6" in out and (tmp_path / "report.html").exists()
    rerun = next(r["rerun"] for r in doc["results"] if r["op"] == "sigmoid")  # the case it broke on
    done = rerun_elsewhere(tmp_path, rerun)
    assert done.returncode == EXIT_BROKEN and evidence in done.stdout, done.stdout[-3000:]


def test_a_theorem_whose_adapter_raises_is_broken_and_has_a_rerun_command(tmp_path):
    status, out, doc = suite(tmp_path, "--backend=tests.faulty:ADAPTERS.sigmoid_raises", "-k", "fixed_points")
    assert status == EXIT_BROKEN, out[-3000:]
    [relation] = doc["relations"]
    assert relation["outcome"] == "errored" and "kernel not compiled" in relation["message"]
    done = rerun_elsewhere(tmp_path, relation["rerun"])
    assert done.returncode == EXIT_BROKEN and "kernel not compiled" in done.stdout, done.stdout[-3000:]


def test_an_op_that_both_breaks_and_fails_is_reported_broken_with_the_break_to_rerun(tmp_path):
    """Hypothesis reports two distinct bugs as one exception group; the break outweighs the failure."""
    backend = "tests.faulty:ADAPTERS.softmax_raises_on_long_rows_and_is_wrong_on_short"
    status, out, doc = suite(tmp_path, f"--backend={backend}", "-k",
                             "softmax_is_a_distribution or (test_matches_oracle and -softmax])")
    assert status == EXIT_BROKEN and "distinct failures" in out, out[-3000:]
    [relation], [result] = doc["relations"], doc["results"]
    for entry in (relation, result):
        assert entry["outcome"] == "errored" and "rows longer than 2" in entry["message"], entry
        done = rerun_elsewhere(tmp_path, entry["rerun"])
        assert done.returncode == EXIT_BROKEN and "rows longer than 2" in done.stdout, done.stdout[-3000:]


def test_a_report_that_cannot_be_written_exits_6_naming_it_and_the_other_is_still_written(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    blocked = tmp_path / "a-file" / "report.html"
    status, out, doc = suite(tmp_path, "--backend=numpy", "-k", SELECT, f"--report-html={blocked}")
    assert status == EXIT_BROKEN, out[-3000:]
    assert f"the HTML report {blocked} could not be written: FileExistsError" in out
    assert outcomes(doc)["rms"] == "passed"  # the JSON report was written all the same


def test_a_known_deviation_is_excused_and_reported_and_stale_entries_are_warned_about(tmp_path):
    status, out, doc = suite(tmp_path, f"--backend={EPS_MISSING}", "-k", SELECT, deviations=f"""
backend: {EPS_MISSING}
deviations:
  - {{op: rms, dtype: float32, reason: eps dropped on purpose}}
  - {{op: sigmoid, dtype: float32, reason: was a fast exp}}
  - {{op: rope, dtype: bfloat16, reason: not in this run}}
""")
    assert status == EXIT_CONFORMANT, out[-3000:]
    rms = next(r for r in doc["results"] if r["op"] == "rms")
    assert rms["outcome"] == "known deviation" and rms["deviation"] == "eps dropped on purpose"
    assert rms["max_ulps"] not in (None, 0)  # still measured
    assert [d["status"] for d in doc["deviations"]] == ["excused", "conforms", "unmatched"]
    assert "float32 sigmoid" in out and "may no longer deviate" in out
    assert "bfloat16 rope" in out and "matches no test of this run" in out


def test_a_known_deviation_never_excuses_an_adapter_that_breaks(tmp_path):
    backend = "tests.faulty:ADAPTERS.sigmoid_raises"
    status, out, doc = suite(tmp_path, f"--backend={backend}", "-k", SELECT,
                             deviations=f"backend: {backend}\ndeviations:\n"
                                        "  - {op: sigmoid, dtype: float32, reason: flaky kernel}\n")
    assert status == EXIT_BROKEN, out[-3000:]
    assert outcomes(doc)["sigmoid"] == "errored"
    assert [d["status"] for d in doc["deviations"]] == ["not judged"]
    assert "float32 sigmoid" in out and "was not judged" in out


@pytest.mark.parametrize("option, message", [
    ("--backend=no_such_engine", "--backend: unknown backend 'no_such_engine'"),
    ("--backend=tests.test_adapters:Tunable,tests.test_adapters:Tunable[kernel=plain]",
     "--backend: several backends are named 'tunable-plain-64'"),
    ("--known-deviations=missing.yaml", "missing.yaml: cannot read it"),
    ("--ops=rmsnrom", "--ops: unknown ['rmsnrom']; the ops are"),
])
def test_a_bad_option_is_a_usage_error_naming_it(tmp_path, option, message):
    status, out, _ = suite(tmp_path, option)
    assert status == 4 and message in out, out[-2000:]


def test_ops_selects_those_ops_and_the_theorems_relating_them_and_leaves_the_model_tests(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "gemma4_conformance.plugin", "--pyargs",
                           "gemma4_conformance", "--backend=numpy", "--dtype=float32", "--ops=softcap,lm_head",
                           "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    ops = {i.split("-")[-1].rstrip("]") for i in ids if "test_matches_oracle" in i}
    relations = {i.rsplit("-", 1)[-1].rstrip("]") for i in ids if "test_relation_holds" in i}
    assert ops == {"softcap", "lm_head"}, done.stdout[-2000:]
    assert relations == {name for name, r in RELATIONS.items() if {"softcap", "lm_head"} & set(r.ops)} != set()
    assert any("test_forward_matches_reference" in i for i in ids) and any("test_serving" in i for i in ids)


@pytest.mark.parametrize("text, message", [
    ("- op: rms\n", "expected a mapping with 'backend'"),
    ("backend: x\ndeviations: {op: rms}\n", "'deviations' must be a list"),
    ("backend: x\ndeviations:\n  - {op: rms, dtype: float32}\n", "deviations[0] lacks reason"),
    ("backend: x\ndeviations:\n  - {op: rms, dtype: float32, reason: r, ticket: 3}\n", "unknown field(s) ticket"),
    ("backend: x\ndeviations:\n  - {op: rmsnrom, dtype: float32, reason: r}\n", "'rmsnrom' is neither an op"),
    ("backend: x\ndeviations:\n  - {op: rms, dtype: fp32, reason: r}\n", "'fp32' is not one of"),
    ("backend: x\ndeviations: [\n", "not valid YAML"),
])
def test_a_malformed_deviations_file_is_refused_naming_the_file_and_entry(tmp_path, text, message):
    path = tmp_path / "deviations.yaml"
    path.write_text(text)
    with pytest.raises(DeviationsError) as error:
        Deviations.load([str(path)])
    assert str(path) in str(error.value) and message in str(error.value)


def test_every_shipped_deviations_file_loads_and_names_its_backend():
    from gemma4_conformance.properties import deviations
    for name in deviations.shipped():
        entries = Deviations.load([name]).entries
        assert entries and {e.backend for e in entries} == {name.removesuffix("-cuda")}, name


def test_a_shipped_deviations_file_is_passed_by_its_name(tmp_path, monkeypatch):
    from gemma4_conformance.properties import deviations
    monkeypatch.setattr(deviations, "SHIPPED", tmp_path)
    (tmp_path / "someengine.yaml").write_text("backend: someengine\ndeviations:\n"
                                              "  - {op: rope, dtype: float16, reason: fp16 angles}\n")
    [entry] = Deviations.load(["someengine"]).entries
    assert (entry.backend, entry.op, entry.file) == ("someengine", "rope", str(tmp_path / "someengine.yaml"))
    with pytest.raises(DeviationsError, match=r"otherengine: neither a file nor .* \(shipped: someengine\)"):
        Deviations.load(["otherengine"])
    with pytest.raises(DeviationsError, match="cannot read"):  # a path stays a path
        Deviations.load([str(tmp_path / "missing.yaml")])


def test_a_broken_tests_long_message_keeps_its_start_and_its_cause():
    """On the H100 (docs/gpu.md) jaxlib wrapped an error in "Exception raised in callback:" and the whole
    Python stack, 2000 characters of frames before the cause, which the report cut off."""
    frames = "".join(f'  File "/site-packages/_pytest/runner.py", line {i}, in call\n' for i in range(100))
    message = f"ContractViolation: jax.rope in float64 raised RuntimeError: Exception raised in callback: " \
              f"Traceback (most recent call last):\n{frames}KeyboardInterrupt"
    kept = clipped(message)
    assert kept.startswith("ContractViolation: jax.rope in float64 raised RuntimeError")
    assert kept.endswith("in call\nKeyboardInterrupt") and len(kept) < 2100 and "characters left out" in kept
    assert clipped("short") == "short"


def test_only_a_failure_beyond_budget_counts_as_nonconformance():
    assert not is_broken(pytest.fail.Exception("beyond budget"))
    assert is_broken(RuntimeError("kernel"))
    assert is_broken(AssertionError("the suite's own check"))
    assert not is_broken(BaseExceptionGroup("two", [pytest.fail.Exception("a"), pytest.fail.Exception("b")]))
    assert is_broken(BaseExceptionGroup("two", [pytest.fail.Exception("a"), ValueError("b")]))


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_a_partial_adapters_unsupported_ops_are_one_line_not_a_skip_per_test(tmp_path, workers):
    status, out, doc = suite(tmp_path, "--backend=examples.minimal_adapter:MinimalAdapter", "--ops=sigmoid,silu,rope",
                             "-ra", "-k", "test_matches_oracle or test_relation_holds", *workers)
    assert status == EXIT_CONFORMANT, out[-3000:]
    assert outcomes(doc)["silu"] == outcomes(doc)["rope"] == "unsupported"
    assert "does not implement" not in out  # no line per skipped test in pytest's -ra summary
    lines = [line for line in out.splitlines() if "unsupported:" in line]
    assert lines == ["minimal  unsupported: 2 ops not implemented, skipped with every test that needs them: "
                     "silu, rope"], out[-3000:]
    assert re.search(r"\b\d+ unsupported\b", out.splitlines()[-1])  # counted apart from skips in pytest's last line


def test_openmp_threads_wait_passively_unless_the_user_says_otherwise():
    """Loading the plugin sets OMP_WAIT_POLICY before any backend loads OpenMP (torch's threads would
    otherwise spin on cores other processes share), and keeps a value the user set."""
    import subprocess
    import sys

    code = ("import os, sys, gemma4_conformance.plugin; "
            "print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["PASSIVE", "False"]
    run = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True)
    assert run.stdout.split()[0] == "ACTIVE"
