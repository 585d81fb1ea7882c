#!/usr/bin/env bash
# Build libcapstan with AddressSanitizer + UndefinedBehaviorSanitizer and run
# the native tests against it (CAPSTAN_NATIVE_LIB points the binding at it).
# Python itself is not instrumented, so the ASan runtime must be loaded first:
# LD_PRELOAD of the compiler's libasan. Leak checking is off because CPython
# and torch keep allocations alive until exit by design.
#
#   tools/check_native_sanitize.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/native-asan
CAPSTAN_NATIVE_SANITIZE=1 python native/build_native.py --out "$out" >/dev/null
CXX=${CXX:-g++}
asan=$($CXX -print-file-name=libasan.so)
ubsan=$($CXX -print-file-name=libubsan.so)
export CAPSTAN_NATIVE_LIB="$PWD/$out/libcapstan.so"
export LD_PRELOAD="$asan:$ubsan"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The 1M-element torch.optim parity runs are left out: under ASan they take
# minutes and exercise the same kernel code as the smaller sizes.
# The test suite runs the same check: native/tests/test_sanitized_build.py.
exec hatch run test native/tests -q -p no:cacheprovider \
  -k "not test_matches_torch_optim_1m and not 2_24 and not missing_library and not sanitized" "$@"
