#!/usr/bin/env bash
# The GPU battery: prove capstan's GPU path on a bare GPU machine without network access, in two runs of
# at most 10 minutes each (docs/gpu.md, "The GPU battery"). From the repository root:
#
#   bash tools/gpu/battery.sh --part 1     # build libcapstan, capstan info, pytest -m cuda, parity, speed point,
#                                          # its profile, the host's CPU Adam kernels (tests per ISA, timing)
#   bash tools/gpu/battery.sh --part 2     # peers (FSDP2, DeepSpeed) throughput and profile, scale probe
#   bash tools/gpu/battery.sh              # both parts, one after the other (each within its own budget)
#   bash tools/gpu/battery.sh --device standin            # on the CPU's stand-in accelerator, tiny sizes
#   bash tools/gpu/battery.sh --part 1 --only parity      # some steps only (comma-separated names)
#   bash tools/gpu/battery.sh --dry-run                   # the setup only: say what would run
#
# Every part writes $OUT/summary.json and $OUT/summary.md (default OUT=/tmp/capstan-gpu) after each
# step (tools/gpu/summary.py), and each step's whole output to $OUT/<step>.log. A part runs within
# CAPSTAN_BATTERY_BUDGET seconds (default 540): each step gets at most its own cap and what is left of
# the budget, stops there (`timeout`), and the steps that run their own subprocesses (parity, the
# benchmark) are told to finish a little earlier, so a part always ends with its summary written,
# whatever hangs. The exit status is 0 when every step of every part run passed or was skipped by
# design (summary.md then says "ok" for the part).
#
# What the machine needs: python3 with a CUDA build of torch (>= 2.4), pytest and numpy, a C++ compiler,
# and (for the peers) FSDP2 in torch; DeepSpeed only where its wheel is carried in. Nothing is
# installed and no index is asked: the source trees go on PYTHONPATH (capstan is a namespace package,
# so they combine), and libcapstan is compiled in place. Python packages the machine lacks travel as
# wheels in .whl/ (pip install --no-index --target), e.g. deepspeed (built elsewhere with
# `pip wheel --no-deps`) and the pure-Python packages it needs. pytest-timeout and hypothesis are
# welcome but not required: without pytest-timeout there is no per-test limit (the step's cap still
# holds); test modules that need hypothesis skip themselves; one module that fails to import costs its
# own tests, never the run (--continue-on-collection-errors).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/capstan-gpu}
PY=${PYTHON:-python3}
BUDGET=${CAPSTAN_BATTERY_BUDGET:-540}
DEVICE=cuda PART=all ONLY="" DRY=0
usage() { sed -n '2,12p' "$0" >&2; exit 2; }
while (( $# )); do
  case $1 in
    --device) DEVICE=${2:-}; shift 2 ;;
    --part) PART=${2:-}; shift 2 ;;
    --only) ONLY=${2:-}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    *) usage ;;
  esac
done
[[ $DEVICE == cuda || $DEVICE == standin ]] || { echo "battery: --device is cuda or standin" >&2; exit 2; }
[[ $PART == 1 || $PART == 2 || $PART == all ]] || { echo "battery: --part is 1, 2 or all" >&2; exit 2; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Multi-rank tests start their ranks as fresh interpreters on the GPU machine, as every lease so far did: the
# fork server (docs/testing.md) saves seconds a rank on 2 CI cores, little on 16, and has not met a CUDA
# build yet. The stand-in run keeps it, as the suite does.
[[ $DEVICE == cuda ]] && export CAPSTAN_TEST_FORKSERVER=${CAPSTAN_TEST_FORKSERVER:-0}

if [[ $DEVICE == standin ]] && compgen -G ".whl/*.whl" > /dev/null; then
  # .whl/ holds the GPU machine's wheels (its Python, its platform): the stand-in runs on this machine's
  echo "battery: the stand-in leaves the carried wheels in .whl/ alone (they are for the GPU machine)"
elif compgen -G ".whl/*.whl" > /dev/null; then
  if (( DRY )); then
    echo "would install: $(ls .whl/*.whl | tr '\n' ' ')"
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/capstan-site \
      .whl/*.whl 2>&1 | tee "$OUT/wheels.log" \
      || { echo "battery: installing the carried wheels failed (log: $OUT/wheels.log)" >&2; exit 1; }
  fi
  export PYTHONPATH=/tmp/capstan-site:${PYTHONPATH:-}
  export PATH=/tmp/capstan-site/bin:$PATH
fi
SRC="$ROOT/native/src"
for pkg in comm chunkmem tensorpar pipeline engine; do SRC="$SRC:$ROOT/packages/$pkg/src"; done
export PYTHONPATH=$SRC:${PYTHONPATH:-}

has() { "$PY" -c "import $1" > /dev/null 2>&1; }
# The parity tests of test_gpu.py are the parity step's own layouts (tools/gpu/parity.py): run once, there.
PYTEST=("$PY" -m pytest -m cuda -p no:cacheprovider -q -ra --continue-on-collection-errors
        --deselect integration_tests/test_gpu.py::test_single_gpu_layouts_match_the_cpu
        --deselect integration_tests/test_gpu.py::test_two_ranks_sharing_the_gpu_match_the_cpu)
if [[ $DEVICE == cuda ]]; then
  if has pytest_timeout; then
    PYTEST+=(--timeout "${CAPSTAN_GPU_TEST_TIMEOUT:-120}")
  else
    echo "battery: pytest-timeout is not installed (carry its wheel in .whl/): no per-test timeout," \
         "the tests step's cap holds"
  fi
  has hypothesis || echo "battery: hypothesis is not installed: test modules that need it are skipped"
fi

# Sizes: a ~0.1B GPT for the speed point, a ~0.9B one for the peers, d 2048 for the scale search; the
# stand-in gets tiny ones (bench_gpu.py --tiny), its memory capped so the scale search ends.
if [[ $DEVICE == cuda ]]; then
  SPEED=(--quick); PEERS=(--d-model 2048 --layers 16 --seq 1024 --micro 4 --steps 5)
  SCALE=(--scale-d-model 2048 --seq 1024 --micro 1 --scale-resolution 1.5)  # a probe of billions: ~a minute
  PROFILE=(); PROFILE_PEERS=(--d-model 2048 --layers 16 --seq 1024 --micro 4)
  KERNELS=(--params 100000000 --reps 5); KERNEL_TESTS="isa or slices or thread or 8bit"
  BUILD=("$PY" native/build_native.py -j "$(nproc)")
else
  SPEED=(--tiny); PEERS=(--tiny); SCALE=(--tiny); PROFILE=(--tiny); PROFILE_PEERS=(--tiny)
  # the same step, its tests cut to a few (the suite runs them all in native/tests)
  KERNELS=(--params 1000000 --reps 3); KERNEL_TESTS="scalar and (8bit or bit_for_bit_the_reference)"
  # the stand-in proves the build step, into a scratch directory: the library in the tree stays as it is
  BUILD=("$PY" native/build_native.py -j "$(nproc)" --out /tmp/capstan-battery-native)
fi
DISK=/tmp/capstan-battery-disk
read -r -a PARITY_EXTRA <<< "${CAPSTAN_PARITY_ARGS:-}"

summary() { "$PY" tools/gpu/summary.py "$@" --out "$OUT" --part "$CURRENT" --device "$DEVICE" > /dev/null; }

# step NAME CAP RESULT -- COMMAND...: run COMMAND within min(CAP, what is left of the part) seconds,
# its output in $OUT/NAME.log, and record it in the summary with RESULT (a JSON report, or -). In
# COMMAND, @LEFT@ becomes that time less 20 s: the deadline a step with subprocesses keeps by itself.
step() {
  local name=$1 cap=$2 result=$3; shift 4
  LAST_RC=0
  if [[ -n $ONLY && ",$ONLY," != *",$name,"* ]]; then return 0; fi
  local left=$(( PART_END - $(date +%s) ))
  (( cap > left )) && cap=$left
  local cmd=("${@//@LEFT@/$(( cap > 40 ? cap - 20 : cap / 2 ))}")
  if (( DRY )); then
    echo "would $name: timeout -k 10 $cap ${cmd[*]}"
    LAST_RC=0
    return 0
  fi
  if (( cap < 15 )); then
    echo "== $name: not run, the part's budget ($BUDGET s) is spent"
    summary step --name "$name" --not-run "the part's budget ($BUDGET s) was spent before it"
    LAST_RC=1
    return 0
  fi
  echo "== $name (at most $cap s; log $OUT/$name.log)"
  [[ $result != - ]] && rm -f "$result"
  local t0=$(date +%s)
  timeout -k 10 "$cap" "${cmd[@]}" 2>&1 | tee "$OUT/$name.log" | tail -n 40
  local rc=${PIPESTATUS[0]}
  # Ranks a test started run in sessions of their own (comm.testing): a step stopped at its limit leaves
  # them running, holding the GPU's memory into the next step. None outlives its step on the GPU machine
  # (not on the stand-in: this machine may be running another suite's ranks).
  [[ $DEVICE == cuda ]] && { pkill -KILL -f "capstan.comm.testing.worker" 2> /dev/null || true; }
  summary step --name "$name" --rc "$rc" --seconds $(( $(date +%s) - t0 )) --log "$OUT/$name.log" \
    $([[ $result != - ]] && echo --result "$result")
  LAST_RC=$rc
  return 0
}

skip() {  # skip NAME REASON: a step that does not apply here, recorded with its reason
  if [[ -n $ONLY && ",$ONLY," != *",$1,"* ]]; then return 0; fi
  if (( DRY )); then echo "would skip $1: $2"; return 0; fi
  echo "== $1: skipped ($2)"
  summary step --name "$1" --skipped "$2"
}

# The device must work before anything is measured on it (a part stops here when it does not).
if [[ $DEVICE == cuda ]]; then
  CHECK="import torch, sys; torch.cuda.is_available() or sys.exit('battery: torch sees no GPU'); print(torch.ones(1, device='cuda'))"
else
  CHECK="from capstan.native import standin; standin.load(); import torch; print(torch.ones(1, device='standin'))"
fi

part1() {
  step build 180 - -- "${BUILD[@]}"
  step info 90 - -- "$PY" -m capstan.engine.cli info
  step device 120 - -- "$PY" -c "$CHECK"
  (( LAST_RC == 0 )) || { echo "battery: $DEVICE does not work here: part 1 stops" >&2; return; }
  if [[ $DEVICE == cuda ]]; then
    step tests 210 - -- "${PYTEST[@]}"
  else
    skip tests "pytest -m cuda needs a GPU; the stand-in's own tests run in every CPU suite run (docs/gpu.md)"
  fi
  step parity 150 "$OUT/parity.json" -- "$PY" tools/gpu/parity.py --device "$DEVICE" --deadline @LEFT@ \
    --json "$OUT/parity.json" ${PARITY_EXTRA[@]+"${PARITY_EXTRA[@]}"}
  step speed 240 "$OUT/speed.json" -- "$PY" tools/bench_gpu.py --device "$DEVICE" --sections speed "${SPEED[@]}" \
    --timeout 150 --deadline @LEFT@ --json "$OUT/speed.json"
  # why the speed point is what it is: host and device time by operator and by phase, plain PyTorch's step
  # beside capstan's (log only)
  step profile 90 - -- "$PY" tools/gpu/profile_step.py --device "$DEVICE" --offload plain,none,cpu,cpu-noclip ${PROFILE[@]+"${PROFILE[@]}"}
  # The offload steps' CPU Adam on the GPU host's own CPU (likely AVX-512, which this project's 2-core
  # machines may lack): the kernels bit for bit against the scalar path on every ISA the CPU has, then
  # fp32, bf16 and 8-bit moments timed against copies of the bytes each touches (log only)
  step cpu-kernels 60 - -- bash -c '"$0" -m pytest -p no:cacheprovider -q -rN native/tests/test_adam.py \
    native/tests/test_adam_bf16_moments.py native/tests/test_adam_q8.py native/tests/test_adam_bf16_master.py \
    -k "$1" && "$0" tools/bench_native.py --only moments "${@:2}"' "$PY" "$KERNEL_TESTS" "${KERNELS[@]}"
}

part2() {
  step device 120 - -- "$PY" -c "$CHECK"
  (( LAST_RC == 0 )) || { echo "battery: $DEVICE does not work here: part 2 stops" >&2; return; }
  step peers 210 "$OUT/peers.json" -- "$PY" tools/bench_gpu.py --device "$DEVICE" --sections peers "${PEERS[@]}" \
    --timeout 150 --deadline @LEFT@ --json "$OUT/peers.json"
  step profile-peers 90 - -- "$PY" tools/gpu/profile_step.py --device "$DEVICE" --offload cpu "${PROFILE_PEERS[@]}"
  # CAPSTAN_SCALE_SYSTEMS (plain,cpu,disk): some of the searches only, where a lease's calls split them; the
  # last run's results in this $OUT are kept for the systems not searched now (scale.earlier.json).
  # CAPSTAN_SCALE_KNOWN (plain:140,cpu:133,disk:187): layers an earlier lease saw fit; each search starts above
  if [[ -n ${CAPSTAN_SCALE_SYSTEMS:-} && -f $OUT/scale.json && ( -z $ONLY || ",$ONLY," == *",scale,"* ) ]] \
      && (( ! DRY )); then
    mv "$OUT/scale.json" "$OUT/scale.earlier.json"
  fi
  step scale 600 "$OUT/scale.json" -- "$PY" tools/bench_gpu.py --device "$DEVICE" --sections scale "${SCALE[@]}" \
    --scale-systems "${CAPSTAN_SCALE_SYSTEMS:-}" --scale-known "${CAPSTAN_SCALE_KNOWN:-}" \
    --scale-earlier "$OUT/scale.earlier.json" --disk "$DISK" \
    --deadline @LEFT@ --json "$OUT/scale.json"
  (( DRY )) || rm -rf "$DISK"
}

STATUS=0
for CURRENT in 1 2; do
  [[ $PART == all || $PART == "$CURRENT" ]] || continue
  PART_START=$(date +%s)
  PART_END=$(( PART_START + BUDGET - 10 ))  # 10 s for the summary at the end
  (( DRY )) || summary begin --budget "$BUDGET"
  echo "== battery part $CURRENT on $DEVICE (budget $BUDGET s; summary in $OUT/summary.md)"
  "part$CURRENT"
  if (( ! DRY )); then
    summary end || STATUS=1  # the part is not ok: a step failed, timed out or did not run
    echo "== battery part $CURRENT: $(( $(date +%s) - PART_START )) s; $OUT/summary.md:"
    cat "$OUT/summary.md"
  fi
done
exit $STATUS
