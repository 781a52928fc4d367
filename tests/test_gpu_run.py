"""benchmarks/gpu_run.sh on the CPU (--device=cpu), as CI can run it: the GPU session's script must work
the first time it meets a GPU."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks import gpu_run
from gemma4_conformance import report
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.report.record import Recorder
from gemma4_conformance.properties import recorded
from gemma4_conformance.spec.model import nodes

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_run_script_runs_its_jobs_on_the_cpu_and_writes_the_merged_report_and_summary(tmp_path):
    done = subprocess.run([str(ROOT / "benchmarks" / "gpu_run.sh"), "--device=cpu", "--quick",
                           "--only=torch-tf32-on,jax-sdpa-cudnn", f"--out={tmp_path}", "--", "--dtype=float32"],
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"gpu.html", "summary.txt", "runs.tar.gz",
                                                    "traces-torch-tf32-on.tar.gz"}
    summary = (tmp_path / "summary.txt").read_text()
    assert "left out jax-sdpa-cudnn: it needs a GPU" in summary
    assert "== torch-tf32-on  (--backend=torch[tf32=on])" in summary
    assert re.search(r"exit 0, wall \d+ s, CPU [1-9]\d* s", summary), summary
    assert "torch-tf32-on on cpu; float32 matmuls in IEEE float32" in summary
    assert "float32   3 passed" in summary and "time in the op tests: backend" in summary
    assert "reports: 1 of 1 jobs left one (all whole)" in summary
    with tarfile.open(tmp_path / "runs.tar.gz") as bundle:
        assert set(bundle.getnames()) == {"torch-tf32-on.json", "torch-tf32-on.log", "monitor.log"}
        monitor = bundle.extractfile("monitor.log").read().decode()
    assert re.search(r"\[ +\d+ s\] load [\d.]+ \| torch-tf32-on (started|\d+%) \d+ thr", monitor), monitor
    assert "torch-tf32-on" in (tmp_path / "gpu.html").read_text()
    # The record step: the job's forward written as a trace file that judges as conformant elsewhere.
    assert "recorded torch-tf32-on-float32.safetensors" in summary and "forward test exit 0" in summary
    with tarfile.open(tmp_path / "traces-torch-tf32-on.tar.gz") as bundle:
        assert bundle.getnames() == ["torch-tf32-on-float32.safetensors"]
        bundle.extractall(tmp_path / "traces", filter="data")
    weights = checkpoint.load(generate.write_checkpoint(tmp_path / "ckpt", generate.small_config()))
    found = recorded.load(tmp_path / "traces" / "torch-tf32-on-float32.safetensors", weights)
    assert not found.breaches and len(found.trace) == len(nodes(weights.config))  # every node, on these weights


def test_the_summary_reads_the_stream_of_a_job_that_was_killed(tmp_path):
    """A job killed past its deadline leaves its report's stream (report.Stream): the summary and the closing
    lines read its finished tests from it."""
    recorder = Recorder()
    rms = recorder("torch", "float32", "rms")
    rms.add(0.25, 0.5, {"args": {}}, "pytest ...")
    rms.outcome = "passed"
    stream = report.Stream(tmp_path / "torch.json", report.environment())
    stream.update(recorder, "test_matches_oracle[torch-float32-rms]")
    stream.close()
    (tmp_path / "torch.json").open("a").write('{"test": "cut sho')  # the line the kill cut
    job = gpu_run.JOBS[0]
    result = {"status": -9, "wall": 450.0, "interrupted": True}
    lines = gpu_run.summarize(job, result, tmp_path)
    assert any("report read from its stream: the run stopped after 1 finished test," in line for line in lines)
    assert any(line.strip() == "float32   1 passed; least headroom rms 2x" for line in lines), lines
    assert gpu_run.closing([job], {job.name: result}, tmp_path)[0] == (
        "reports: 1 of 1 jobs left one (1 read from the stream of a job that was killed: torch)")


def fake_mps_control(folder: Path, status: int = 0) -> Path:
    """An ``nvidia-cuda-mps-control`` that logs its arguments, its MPS folders and its input, in ``folder``."""
    program = folder / "bin" / gpu_run.Mps.CONTROL
    program.parent.mkdir()
    program.write_text(f"#!/bin/sh\necho \"$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY "
                       f"input=$(test $# = 0 && cat)\" >> {folder / 'calls'}\nexit {status}\n")
    program.chmod(0o755)
    return program.parent


def test_on_a_gpu_the_jobs_share_it_through_mps_unless_a_library_cannot_use_it(tmp_path, monkeypatch):
    args = argparse.Namespace(device="cuda", mps="auto")
    monkeypatch.setenv("PATH", str(fake_mps_control(tmp_path)), prepend=os.pathsep)
    seen = []  # the MPS pipe folder each preflight ran with
    monkeypatch.setattr(gpu_run, "preflight", lambda device, timeout=300: seen.append(
        os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) or {})
    problems, mps, note = gpu_run.gpu_service(args)
    assert not problems and note == "MPS: on (nvidia-cuda-mps-control -d), the jobs' kernels share the GPU"
    pipe = seen[0]
    assert pipe and (tmp_path / "calls").read_text() == f"-d pipe={pipe} log={Path(pipe).parent / 'log'} input=\n"
    assert gpu_run._env()["CUDA_MPS_PIPE_DIRECTORY"] == pipe  # the jobs find the daemon
    mps.stop()
    assert (tmp_path / "calls").read_text().splitlines()[1] == f" pipe={pipe} log={Path(pipe).parent / 'log'} input=quit"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and not Path(pipe).exists()

    # A library that cannot reach the GPU through the daemon: it is stopped, the preflight runs again without it.
    (tmp_path / "calls").unlink()
    seen.clear()
    monkeypatch.setattr(gpu_run, "preflight", lambda device, timeout=300: seen.append(
        os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) or ({"jax": "no GPU"} if len(seen) == 1 else {}))
    problems, mps, note = gpu_run.gpu_service(args)
    assert not problems and mps is None and seen[0] and seen[1] is None
    assert note == "MPS: stopped, the GPU was not usable through it (jax: no GPU)"
    assert [line.split()[0] for line in (tmp_path / "calls").read_text().splitlines()] == ["-d", "pipe=" + seen[0]]


def test_mps_that_does_not_start_leaves_the_jobs_time_slicing(tmp_path, monkeypatch):
    args = argparse.Namespace(device="cuda", mps="auto")
    monkeypatch.setattr(gpu_run, "preflight", lambda device, timeout=300: {})
    monkeypatch.setenv("PATH", str(tmp_path))  # no control program
    assert gpu_run.gpu_service(args)[1:] == (None, "MPS: not used (no nvidia-cuda-mps-control on the PATH); "
                                                   "the GPU time-slices the jobs")
    monkeypatch.setenv("PATH", str(fake_mps_control(tmp_path, status=1)))
    _, mps, note = gpu_run.gpu_service(args)
    assert mps is None and note.startswith("MPS: not used (nvidia-cuda-mps-control -d exited 1")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_on_a_gpu_a_job_takes_the_known_deviations_the_suite_ships_for_it():
    """torch-sdpa's FlashAttention returns NaN at scale 0 on CUDA (deviations/torch-sdpa-cuda.yaml): the plain
    torch-sdpa job reports it as that known deviation; its variants, and every job on the CPU, are left as they are."""
    jobs = {job.name: job for job in gpu_run.JOBS}
    def options(name, device):
        args = argparse.Namespace(device=device, quick=False, profile="default", pytest_args=[])
        return [o for o in gpu_run.command(jobs[name], args, Path("r.json"), True) if o.startswith("--known")]
    assert options("torch-sdpa", "cuda") == ["--known-deviations=torch-sdpa-cuda"]
    assert options("torch-sdpa", "cpu") == options("torch-sdpa-tf32-on", "cuda") == options("torch", "cuda") == []
