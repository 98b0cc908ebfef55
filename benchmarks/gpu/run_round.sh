#!/usr/bin/env bash
# One GPU round on the device machine: install carried wheels, then run the named steps in order, each with its
# own time limit, all writing JSON under $OUT. Usage: bash benchmarks/gpu/run_round.sh STEP...
# Steps: fwd (forward gate + FLA timing), bwd, decode, matmul, bench, demo.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
export LINATTN_COMMIT=${LINATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    fwd)    timeout 300 python3 benchmarks/gpu/gdn_fwd_gate.py --out "$OUT" --fla ;;
    bwd)    timeout 300 python3 benchmarks/gpu/gdn_bwd_gate.py --out "$OUT" --fla ;;
    decode) timeout 200 python3 benchmarks/gpu/decode_gate.py --out "$OUT" --fla ;;
    matmul) timeout 240 python3 benchmarks/gpu/matmul_gate.py --out "$OUT" ;;
    profile) timeout 200 python3 benchmarks/gpu/profile_fwd.py --out "$OUT" --fla ;;
    bench)  timeout 300 bash benchmarks/gpu/bench_production.sh ;;
    demo)   timeout 120 python3 -m linattn.cli demo 2>&1 | tee "$OUT/demo.txt" ;;
    *) echo "unknown step $step" ;;
  esac
  echo "=== $step exit $? $(date +%T)"
done
