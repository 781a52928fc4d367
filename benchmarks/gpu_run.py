"""The main job on a GPU, in one go: torch (eager and SDPA, TF32 on and off) and JAX (XLA and its fused
attention), one merged report, each verdict matrix's summary and the wall times.

    benchmarks/gpu_run.sh                          # on a machine with an NVIDIA GPU (the default, --device=cuda)
    benchmarks/gpu_run.sh --device=cpu --quick     # the same jobs on the CPU, a few ops: tests this script
    benchmarks/gpu_run.sh --out=$OUT --deadline=420 --only=torch,jax

Each backend configuration is its own pytest process (``pytest --backend=SPEC --device=DEVICE``, the
default Hypothesis profile, the test kinds in the order of ``KINDS``), all run side by side (the
oracle is single-threaded and dominates; a GPU is shared well by a dozen small processes), each
stopped with SIGINT at ``--deadline`` seconds so that it still writes its report, and killed
``KILL_AFTER`` seconds later if it has not stopped (its report's stream keeps every test it
finished).  Then the reports are merged into one page and the summary is printed and written beside
it, ending with the closing lines (``closing``: the reports each job left, jax's compile time).
Each job's thread pools get its share of the cores (``_env``); the summary gives its exit, wall and CPU
time, and ``Monitor`` samples the load, the GPU's use and each job's CPU share and threads every 10 s.
``--out`` receives (the device tool returns at most eight files, 16 MiB each): ``gpu.html`` (the
merged page), ``summary.txt`` (what is printed), ``runs.tar.gz`` (each job's JSON report and log, and
``monitor.log``),
per library ``traces-JOB.tar.gz`` and, on a GPU, ``sdpa-nan.txt`` (``sdpa_nan_check``).

Beside the jobs run the record step and, on a GPU, the SDPA NaN check.  The record step: each
library's first job runs its forward once more, in bf16 (the forward test
alone, no oracle work), with ``--record-traces``, so its trace files (every node of the generated
checkpoint, about 10 MB) can be judged on any CPU: ``python -m gemma4_conformance.checkpoints.generate
CKPT`` writes the same checkpoint (the file's checkpoint_sha256 says so), then ``gemma4-conformance
judge FILE --weights=CKPT``.

Jobs that need a GPU (cuDNN attention) are left out on the CPU, and said so.  A job that exits 4 (a
usage error: its device or library is missing) is reported with its message; the others still run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NEEDED = ("numpy", "mpmath", "hypothesis", "pytest", "yaml", "ml_dtypes", "safetensors", "jinja2", "matplotlib")


@dataclass
class Job:
    name: str  # the file stem of its report and log
    spec: str  # --backend
    library: str  # torch or jax
    why: str  # what this configuration shows
    gpu_only: bool = False


JOBS = [
    Job("torch", "torch", "torch", "eager torch, the process's defaults (TF32 off for matmuls; bf16/fp16 "
                                   "reduced-precision reductions on)"),
    Job("torch-tf32-on", "torch[tf32=on]", "torch", "TF32 for float32 matmuls: expected to fail float32 linear budgets"),
    Job("torch-reduced-off", "torch[reduced=off]", "torch", "cuBLAS's bf16/fp16 reduced-precision reductions off"),
    Job("torch-sdpa", "torch-sdpa", "torch", "SDPA (torch chooses the kernel) and F.rms_norm"),
    Job("torch-sdpa-tf32-on", "torch-sdpa[tf32=on]", "torch", "the same with TF32 on"),
    Job("torch-sdpa-gqa-repeat", "torch-sdpa[gqa=repeat]", "torch",
        "KV heads repeated rather than enable_gqa, so the memory-efficient and cuDNN kernels qualify"),
    Job("jax", "jax", "jax", "XLA, matmuls at precision highest"),
    Job("jax-precision-default", "jax[precision=default]", "jax", "XLA at its default matmul precision"),
    Job("jax-sdpa", "jax-sdpa", "jax", "jax.nn.dot_product_attention, implementation xla"),
    Job("jax-sdpa-cudnn", "jax-sdpa[implementation=cudnn]", "jax", "jax.nn.dot_product_attention through cuDNN",
        gpu_only=True),
]
# The test kinds in the order each job runs them (pytest keeps the order of its arguments): the few
# whole-model tests first, then the theorems, then the op tests, which take the rest of the deadline
# (docs/gpu.md: what each took on the H200, and what is left).
KINDS = tuple(f"gemma4_conformance.properties.{kind}" for kind in
              ("test_forward", "test_serving", "test_invariance", "test_relations", "test_agreement"))
KILL_AFTER = 30  # seconds after its SIGINT that a job still running is killed (its report's stream stays)
QUICK_OPS = "test_matches_oracle and (-linear] or -causal_gqa] or -rmsnorm])"  # --quick: a matmul, attention, a norm
# The bf16 decode that torch-sdpa returned NaN for on the H200 (2026-12-04): rerun with each SDPA kernel
# forced (sdpa_nan_check), beside benchmarks/sdpa_nan_repro.py's torch-only calls.
SDPA_NAN_CASE = ('{"args":{"scale":0.0,"q":{"shape":[1,1,1],"dist":"normal","log2":0,"seed":0},'
                 '"k":{"shape":[1,1,1],"dist":"normal","log2":0,"seed":0},'
                 '"v":{"shape":[1,1,1],"dist":"integers","log2":0,"seed":1}},"offset":0}')
SDPA_KERNELS = ("", "cudnn", "flash", "efficient", "math")  # "": torch's choice
CERTIFICATION = "test_reference_is_certified_by_the_oracle"  # the suite's own check of its reference: once per run
RECORDING = "test_forward_matches_reference"  # the record step's test: the forward, its trace file written


def preflight(device: str, timeout: float = 300) -> dict[str, str]:
    """Per library, "" when it can run on ``device``, else why not; exits when the suite cannot run at all."""
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"gpu_run: the suite needs {', '.join(missing)}, not installed for {sys.executable}. On a machine "
                 f"without a registry, carry their wheels (pip download --no-deps --python-version "
                 f"{sys.version_info.major}.{sys.version_info.minor} ...) and install them with "
                 f"pip install --no-index --target DIR, then PYTHONPATH=DIR.")
    problems = {}
    for library in ("torch", "jax"):
        if importlib.util.find_spec(library) is None:
            problems[library] = f"{library} is not installed for {sys.executable}"
            continue
        probe = (f"from gemma4_conformance.adapters import {library}_backend as b; d = b.resolve_device({device!r}); "
                 f"print(b.device_environment(d))")
        try:
            done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(),
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            problems[library] = f"its probe of {device} did not answer in {timeout:.0f} s"
            continue
        if done.returncode:
            problems[library] = (done.stderr.strip().splitlines() or ["failed"])[-1]
        else:
            print(f"{library}: {done.stdout.strip()}")
    return problems


class Mps:
    """CUDA's Multi-Process Service, for the jobs' GPU.  Without it the GPU time-slices the jobs' contexts,
    and the serving and invariance tests' many small kernels wait their turns (docs/gpu.md, the H100 run).
    Through MPS the processes' kernels run side by side in one context.  Its daemon's pipe and log folders go in ``folder``; the
    children find them through the environment (``_env`` copies it)."""

    CONTROL = "nvidia-cuda-mps-control"
    FOLDERS = {"CUDA_MPS_PIPE_DIRECTORY": "pipe", "CUDA_MPS_LOG_DIRECTORY": "log"}

    def __init__(self, folder: Path):
        self.folder = folder

    def start(self) -> str:
        """Starts the daemon; returns "" or why it is not running."""
        control = shutil.which(self.CONTROL)
        if control is None:
            return f"no {self.CONTROL} on the PATH"
        for name, sub in self.FOLDERS.items():
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
            os.environ[name] = str(self.folder / sub)
        try:
            done = subprocess.run([control, "-d"], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            done = None
        if done is None or done.returncode:
            self.stop()
            return f"{self.CONTROL} -d " + ("did not return in 30 s" if done is None else
                                              f"exited {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}")
        return ""

    def stop(self) -> None:
        control = shutil.which(self.CONTROL)
        if control and os.environ.get("CUDA_MPS_PIPE_DIRECTORY") == str(self.folder / "pipe"):
            try:
                subprocess.run([control], input="quit\n", capture_output=True, text=True, timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for name in self.FOLDERS:
            os.environ.pop(name, None)
        shutil.rmtree(self.folder, ignore_errors=True)


def gpu_service(args) -> tuple[dict[str, str], Mps | None, str]:
    """The preflight's problems per library, the MPS daemon the jobs share (or None) and the summary's line
    about it.  The preflight checks MPS too: where a library cannot use the GPU through it, the daemon is
    stopped and the preflight run again without it."""
    if args.device == "cpu" or args.mps == "off":
        return preflight(args.device), None, "" if args.device == "cpu" else "MPS: off (--mps=off)"
    mps = Mps(Path(tempfile.mkdtemp(prefix="gpu-run-mps-")))
    why = mps.start()
    if why:
        return preflight(args.device), None, f"MPS: not used ({why}); the GPU time-slices the jobs"
    problems = preflight(args.device, timeout=90)
    if not problems:
        return problems, mps, f"MPS: on ({Mps.CONTROL} -d), the jobs' kernels share the GPU"
    mps.stop()
    first = "; ".join(f"{library}: {problem}" for library, problem in problems.items())
    return preflight(args.device), None, f"MPS: stopped, the GPU was not usable through it ({first[:300]})"


def _env(threads: int | None = None) -> dict:
    """The jobs' environment; ``threads``: each job's share of the cores for its thread pools (OpenMP,
    OpenBLAS, MKL; torch reads OMP_NUM_THREADS), unless the caller set them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    # JAX takes 75% of the GPU's memory at start unless told not to: a dozen processes share it here.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # Ten jobs with a pool of a thread per core each would outnumber the cores tenfold, and threads that
    # spin waiting for each other then lose their slices to the other jobs'.
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS") if threads else ():
        env.setdefault(name, str(threads))
    return env


def command(job: Job, args, report: Path, first: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "gemma4_conformance.plugin", "--pyargs", *KINDS,
           f"--backend={job.spec}", f"--device={args.device}", f"--hypothesis-profile={args.profile}",
           "-p", "no:cacheprovider", f"--report-json={report}", "--report-html=", "-q", "--no-header",
           "--durations=60"]
    keywords = ([QUICK_OPS] if args.quick else []) + ([] if first else [f"not {CERTIFICATION}"])
    if keywords:
        cmd += ["-k", " and ".join(f"({k})" for k in keywords)]
    if args.quick:
        cmd.append("--dtype=float32,bfloat16")
    from gemma4_conformance.properties.deviations import shipped  # after preflight: the suite's needs are there

    if args.device != "cpu" and f"{job.spec}-cuda" in shipped():  # measured on a GPU: docs/gpu.md
        cmd.append(f"--known-deviations={job.spec}-cuda")
    return cmd + args.pytest_args


def run(jobs: list[Job], args, work: Path) -> dict[str, dict]:
    """Start every job, stop those past the deadline with SIGINT (pytest still writes its report)."""
    running, results = {}, {}
    pending = list(jobs)
    start = time.monotonic()
    threads = max(1, (os.cpu_count() or 1) // min(args.jobs, len(jobs)))
    monitor = Monitor(work / "monitor.log", args.device != "cpu")
    while pending or running:
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            folder = work / job.name
            folder.mkdir()
            log = open(work / f"{job.name}.log", "w")
            cmd = command(job, args, work / f"{job.name}.json", first=not results and not running)
            log.write(" ".join(cmd) + "\n\n")
            log.flush()
            process = subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=_env(threads),
                                       start_new_session=True)
            running[job.name] = (job, process, time.monotonic(), log)
        time.sleep(1)
        monitor.sample(time.monotonic() - start, {name: process.pid for name, (_, process, _, _) in running.items()})
        for name, (job, process, began, log) in list(running.items()):
            elapsed = time.monotonic() - began
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)  # not poll(): wait4 gives the job's CPU time
            if not pid:
                if elapsed > args.deadline and not results.get(name, {}).get("interrupted"):
                    os.killpg(process.pid, signal.SIGINT)
                    results[name] = {"interrupted": True}
                elif elapsed > args.deadline + KILL_AFTER:
                    os.killpg(process.pid, signal.SIGKILL)
                continue
            log.close()
            process.returncode = os.waitstatus_to_exitcode(status)
            results[name] = {**results.get(name, {}), "status": process.returncode, "wall": elapsed,
                             "cpu": usage.ru_utime + usage.ru_stime}
            del running[name]
            print(f"[{time.monotonic() - start:6.0f} s] {name}: exit {process.returncode} after {elapsed:.0f} s, "
                  f"{results[name]['cpu']:.0f} CPU s"
                  + (" (stopped at the deadline)" if results[name].get("interrupted") else ""), flush=True)
    monitor.close()
    return results


class Monitor:
    """What the machine was doing while the jobs ran, every ``EVERY`` seconds, in ``path`` (bundled with the
    logs): the load average, the GPU's use, and per running job its CPU use since the last sample and its
    threads, read from /proc (Linux; elsewhere the file says so)."""

    EVERY = 10.0

    def __init__(self, path: Path, gpu: bool):
        self.file, self.gpu, self.last, self.ticks = open(path, "w"), gpu, -self.EVERY, {}
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def sample(self, now: float, pids: dict[str, int]) -> None:
        if now - self.last < self.EVERY:
            return
        interval, self.last = now - self.last, now
        try:
            load = Path("/proc/loadavg").read_text().split()[0]
        except OSError:
            self.file.write(f"[{now:6.0f} s] no /proc here: nothing sampled\n")
            return
        parts = [f"load {load}"]
        if self.gpu:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            parts.append(f"gpu {smi.stdout.strip() or smi.stderr.strip()[:80]}")
        for name, pid in pids.items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks = sum(int(f) for f in fields[11:15])  # utime, stime and those of the children it waited for
            used = (ticks - self.ticks.get(name, 0)) / self.hz / interval if name in self.ticks else None
            self.ticks[name] = ticks
            parts.append(f"{name} " + (f"{100 * used:.0f}%" if used is not None else "started") + f" {fields[17]} thr")
        self.file.write(f"[{now:6.0f} s] " + " | ".join(parts) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def sdpa_nan_check(args, out: Path) -> list[str]:
    """Which SDPA kernel returns the NaN: the suite's rerun of the H200's failing case with each kernel
    forced (``torch-sdpa[kernel=...]``), then benchmarks/sdpa_nan_repro.py; all of it in ``out``
    (sdpa-nan.txt), and the summary's lines returned.  Run beside the jobs: it takes seconds."""
    lines, text = [], []
    for kernel in SDPA_KERNELS:
        spec = f"torch-sdpa[kernel={kernel}]" if kernel else "torch-sdpa"
        cmd = [sys.executable, "-m", "pytest", "-p", "gemma4_conformance.plugin", "--pyargs",
               "gemma4_conformance.properties.test_agreement", f"--backend={spec}", f"--device={args.device}",
               "-p", "no:cacheprovider", "--report-html=", "-q", "--no-header", "--dtype=bfloat16",
               "-k", "test_matches_oracle and -decode_gqa]", f"--case={SDPA_NAN_CASE}"]
        done = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, env=_env(), timeout=300)
        output = done.stdout + done.stderr
        found = [line.strip() for line in output.splitlines() if "NaN in the output" in line
                 or "No available kernel" in line or "not run" in line.lower()]
        verdict = {0: "passed", 1: "failed"}.get(done.returncode, f"exit {done.returncode}")
        lines.append(f"   {spec:<28} {verdict}" + (f": {found[0][:160]}" if found else ""))
        text += [f"$ {' '.join(cmd)}", output, ""]
    repro = [sys.executable, str(ROOT / "benchmarks" / "sdpa_nan_repro.py"), f"--device={args.device}"]
    done = subprocess.run(repro, capture_output=True, text=True, env=_env(), timeout=300)
    text += [f"$ {' '.join(repro)}", done.stdout + done.stderr]
    out.write_text("\n".join(text))
    last = (done.stdout.strip().splitlines() or [f"(exit {done.returncode}, no output)"])[-1]
    return (["SDPA NaN check (bf16 decode_gqa, scale 0, one key; each kernel forced; details in "
             f"{out.name}):"] + lines + [f"   sdpa_nan_repro.py: {last[:300]}"])


def closing(jobs: list[Job], results: dict, work: Path) -> list[str]:
    """What the closing note needs in one place: whether each job left its report (whole, or read from its
    stream), and each jax job's compile share."""
    from gemma4_conformance import report

    whole, streamed, lost, shares = [], [], [], []
    for job in jobs:
        try:
            doc = report.load(work / f"{job.name}.json")
        except report.ReportError:
            lost.append(job.name)
            continue
        (streamed if "partial" in doc else whole).append(job.name)
        backend = sum(r.get("seconds", {}).get("backend", 0.0) for r in doc["results"])
        for described in doc["environment"].get("backends", {}).values():
            if "compile_seconds" in described:
                shares.append(f"{job.name} {described['compile_seconds']:.0f} s compiling, {backend:.0f} s in the "
                              f"backend's op calls (exit {results[job.name].get('status')})")
    lines = [f"reports: {len(whole) + len(streamed)} of {len(jobs)} jobs left one"
             + (f" ({len(streamed)} read from the stream of a job that was killed: {', '.join(streamed)})"
                if streamed else " (all whole)") + (f"; LOST: {', '.join(lost)}" if lost else "")]
    if shares:
        lines.append("jax compile time (the process's, shared persistent cache): " + "; ".join(shares))
    return lines


def record(jobs: list[Job], args, work: Path) -> list[str]:
    """The record step (module docstring): each library's first job's bf16 forward, its trace files bundled
    as ``traces-JOB.tar.gz`` in ``--out``; returns the summary's lines."""
    firsts = {}
    for job in jobs:
        firsts.setdefault(job.library, job)
    lines = []
    for job in firsts.values():
        folder = work / "traces" / job.name
        cmd = [sys.executable, "-m", "pytest", "-p", "gemma4_conformance.plugin", "--pyargs",
               "gemma4_conformance.properties.test_forward", f"--backend={job.spec}", f"--device={args.device}",
               "-p", "no:cacheprovider", "--report-html=", "-q", "--no-header", "-k", RECORDING,
               "--dtype=bfloat16", f"--record-traces={folder}", *args.pytest_args]
        began = time.monotonic()
        done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=_env(), timeout=args.deadline + 60)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            tail = (done.stdout + done.stderr).strip().splitlines() or ["(no output)"]
            lines.append(f"   recorded no trace of {job.name} (exit {done.returncode}): {tail[-1][:300]}")
            continue
        bundle = args.out / f"traces-{job.name}.tar.gz"
        with tarfile.open(bundle, "w:gz") as tar:
            for file in files:
                tar.add(file, arcname=file.name)
        size = sum(f.stat().st_size for f in files) / 1e6
        lines.append(f"   recorded {', '.join(f.name for f in files)} ({size:.1f} MB, "
                     f"{time.monotonic() - began:.0f} s, forward test exit {done.returncode}) -> {bundle.name}")
    return ["record step: trace files to judge anywhere (python -m gemma4_conformance.checkpoints.generate CKPT, then "
            "gemma4-conformance judge FILE --weights=CKPT)"] + lines


def summarize(job: Job, result: dict, work: Path) -> list[str]:
    """A job's verdict matrix in a few lines: per dtype the ops passed, failed, errored; its failures;
    the forward and theorems; where the time went; the device and math modes."""
    from gemma4_conformance import report  # after preflight: the suite's dependencies are there
    from gemma4_conformance.report.formatting import shown

    lines = [f"== {job.name}  (--backend={job.spec}): {job.why}"]
    path = work / f"{job.name}.json"
    status = result.get("status")
    lines.append(f"   exit {status}, wall {result.get('wall', 0):.0f} s, CPU {result.get('cpu', 0):.0f} s"
                 + (", stopped at the deadline: results are partial" if result.get("interrupted") else ""))
    try:
        doc = report.load(path)
    except report.ReportError as e:
        log = (work / f"{job.name}.log").read_text(errors="replace").strip().splitlines()
        usage = [line for line in log if "ERROR" in line or "error" in line.lower()]
        lines.append(f"   no report ({e}): {(usage or log or ['(empty log)'])[-1][:300]}")
        return lines
    if "partial" in doc:
        lines.append(f"   report read from its stream: {doc['partial']}")
    for name, described in doc["environment"].get("backends", {}).items():
        where, kind = described.get("device"), described.get("device_name")
        lines.append(f"   {name} on {where}{f' ({kind})' if kind and kind != 'cpu' else ''}; "
                     f"{described.get('math_summary', '')}")
        if described.get("sdpa_kernels_run"):
            lines.append(f"   SDPA kernels run: {described['sdpa_kernels_run']}")
        if "compile_seconds" in described:
            lines.append(f"   jax compiled for {described['compile_seconds']:.1f} s in all (tracing, lowering, "
                         f"compiling; {described['persistent_cache_hits']} programs from the persistent cache)")
    dtypes = []
    for r in doc["results"]:
        if r["dtype"] not in dtypes:
            dtypes.append(r["dtype"])
    for dtype in dtypes:
        rs = [r for r in doc["results"] if r["dtype"] == dtype]
        counts = {}
        for r in rs:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        closest = min((r for r in rs if r["outcome"] == "passed" and isinstance(r["headroom"], (int, float))),
                      key=lambda r: r["headroom"], default=None)
        lines.append(f"   {dtype:<9} " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
                     + (f"; least headroom {closest['op']} {closest['headroom']:.3g}x" if closest else ""))
    for r in doc["results"]:
        if r["outcome"] == "unsupported" and r["message"]:  # arguments the adapter refused (a stated limit)
            lines.append(f"   UNSUPPORTED {r['dtype']:<9} {r['op']:<14} {r['message'][:200]}")
        if r["outcome"] in ("failed", "errored", "known deviation"):
            over = f"{shown(r['worst_ulps'])} ULPs / budget {shown(r['budget_ulps'])}"
            lines.append(f"   {r['outcome'].upper():<8} {r['dtype']:<9} {r['op']:<14} {over}  {r['message'][:160]}")
    for f in doc["forward"]:
        lines.append(f"   forward {f['dtype']}: {f['outcome']}" + (f" ({f['failures'][0][:160]})" if f["failures"] else ""))
    held = sum(r["outcome"] == "passed" for r in doc["relations"])
    lines.append(f"   theorems: {held} of {len(doc['relations'])} held"
                 + "".join(f"; {r['dtype']} {r['relation']} {r['outcome']}" for r in doc["relations"]
                           if r["outcome"] not in ("passed", "unsupported")))
    for p in doc["problems"][:5]:
        lines.append(f"   broken: {p['test']}: {p['message'][:200]}")
    seconds = {"backend": 0.0, "transfer": 0.0, "oracle": 0.0}
    for r in doc["results"]:
        for part, value in r.get("seconds", {}).items():
            seconds[part] = seconds.get(part, 0.0) + value
    total = sum(seconds.values()) or 1.0
    lines.append("   time in the op tests: " + ", ".join(f"{part} {value:.1f} s ({100 * value / total:.0f}%)"
                                                       for part, value in seconds.items()))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to test this script")
    parser.add_argument("--profile", default="default", help="Hypothesis profile: ci, default (the main job), thorough")
    parser.add_argument("--deadline", type=float, default=420, help="seconds before a job is stopped (default 420)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="jobs run at once (default: the CPUs)")
    parser.add_argument("--only", default="", help="comma-separated job names (default: all); see JOBS")
    parser.add_argument("--quick", action="store_true", help="a few ops in float32 and bf16: checks the script")
    parser.add_argument("--mps", choices=("auto", "off"), default="auto",
                        help="on a GPU, run the jobs through CUDA's Multi-Process Service where its daemon starts "
                             "and every library can use the GPU through it (auto, the default), or not (off)")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu", help="where the files go")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    args = parser.parse_args(argv)

    begun = time.monotonic()
    on_gpu = args.device != "cpu"
    problems, mps, service = gpu_service(args)
    try:
        return _main(args, begun, on_gpu, problems, service)
    finally:
        if mps is not None:
            mps.stop()


def _main(args, begun: float, on_gpu: bool, problems: dict[str, str], service: str) -> int:
    jobs = [job for job in JOBS if not args.only or job.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {job.name for job in JOBS}
    if unknown:
        sys.exit(f"gpu_run: no job named {', '.join(sorted(unknown))}; jobs: {', '.join(j.name for j in JOBS)}")
    notes = [service] if service else []
    notes += [f"left out {job.name}: it needs a GPU" for job in jobs if job.gpu_only and not on_gpu]
    notes += [f"left out {job.name}: {problems[job.library]}" for job in jobs if job.library in problems]
    jobs = [job for job in jobs if (on_gpu or not job.gpu_only) and job.library not in problems]
    for note in notes:
        print(note)
    if not jobs:
        sys.exit("gpu_run: no job can run here")

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-run-") as tmp:
        work = Path(tmp)
        print(f"running {len(jobs)} jobs ({args.jobs} at a time) on {args.device}, profile {args.profile}, "
              f"deadline {args.deadline:.0f} s each", flush=True)
        # Beside the jobs (a few processes, seconds each), so that they add nothing to the wall time: the
        # record step and, on a GPU, the SDPA NaN check.  Each returns its summary lines.
        beside = {"record": lambda: record(jobs, args, work)}
        if on_gpu and any(job.library == "torch" for job in jobs):
            beside["sdpa"] = lambda: sdpa_nan_check(args, args.out / "sdpa-nan.txt")
        found = {}
        threads = [threading.Thread(target=lambda name=name, step=step: found.setdefault(name, step()))
                   for name, step in beside.items()]
        for thread in threads:
            thread.start()
        results = run(jobs, args, work)
        lines = [f"gpu_run on {args.device}, profile {args.profile}{' (quick)' if args.quick else ''}: "
                 f"{len(jobs)} jobs, wall {time.monotonic() - begun:.0f} s"] + notes
        for job in jobs:
            lines += summarize(job, results[job.name], work)
        for thread in threads:
            thread.join()
        for name in beside:
            lines += found.get(name, [f"the {name} step raised (its traceback is above)"])
        lines += closing(jobs, results, work)
        reports = [work / f"{job.name}.json" for job in jobs if (work / f"{job.name}.json").exists()]
        if reports:
            from gemma4_conformance import report

            page = report.write_html(args.out / "gpu.html", [report.load(p) for p in reports],
                                     [p.stem for p in reports], title=f"Gemma 4 conformance on {args.device}")
            lines.append(f"merged report: {page}")
        with tarfile.open(args.out / "runs.tar.gz", "w:gz") as bundle:
            for path in sorted(work.glob("*.json")) + sorted(work.glob("*.log")):
                bundle.add(path, arcname=path.name)
        lines.append(f"reports and logs: {args.out / 'runs.tar.gz'}; total wall {time.monotonic() - begun:.0f} s")
    text = "\n".join(lines)
    print("\n" + text)
    (args.out / "summary.txt").write_text(text + "\n")
    return 0 if all(r.get("status") in (0, 1) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
