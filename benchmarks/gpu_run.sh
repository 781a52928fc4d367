#!/usr/bin/env bash
# The main job on a GPU machine (torch eager and SDPA, TF32 on and off; JAX and its fused attention),
# one merged report and a summary, then the record step: each library's bf16 forward written as trace
# files (traces-JOB.tar.gz), to be judged on any CPU with gemma4-conformance judge: see
# benchmarks/gpu_run.py. Run from anywhere:
#   benchmarks/gpu_run.sh [--out=DIR] [--deadline=SECONDS] [--only=torch,jax] [--profile=ci]
#   benchmarks/gpu_run.sh --device=cpu --quick        # checks the script on a machine without a GPU
# It uses the python3 on the PATH (on the device machine, the one with torch and jax), or $PYTHON, and
# installs nothing from a registry: wheels carried in the repository's .whl/ folder, if any, go to a
# private target folder first (pip install --no-index --target).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
if compgen -G "$root/.whl/*.whl" >/dev/null; then
    site="$(mktemp -d)/site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$root"/.whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" -u "$root/benchmarks/gpu_run.py" "$@"
