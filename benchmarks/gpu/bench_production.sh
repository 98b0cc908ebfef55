#!/usr/bin/env bash
# GDN production benchmark on the H200: linattn's triton and gluon backends against FLA (its Triton path), FlashQLA when
# importable, and causal SDPA, forward and forward+backward, every row compared in the same run.
#
#   bash benchmarks/gpu/bench_production.sh hv32    # B1 T8k/32k/64k, B8 T4k, B4 T16k at H16/HV32 + varlen mix
#                                                   # + B1 T64k with slow-decay gates (g x0.01; ~+20 s)
#   bash benchmarks/gpu/bench_production.sh hv64    # the same at H16/HV64
#   bash benchmarks/gpu/bench_production.sh hv8     # the same at H2/HV8
#   bash benchmarks/gpu/bench_production.sh cold    # cold start only: first call of each backend, fwd and fwd+bwd,
#                                                   # B1 T8192 H16/HV32, each in a fresh process with empty caches
#   bash benchmarks/gpu/bench_production.sh merge a.json b.json c.json   # on any machine: one JSON + PNG
#
# Run one part per lease call and fetch $OUT after each (the next call empties it). COLD=1 adds the cold-start
# measurement (fresh processes with empty Triton/Inductor/TileLang caches) for the part's first row; the `cold`
# part does only that. The JIT caches of this script (Triton, Inductor, TileLang) live in $BENCH_CACHE
# (default /tmp/linattn-bench-cache), which the parts share on a machine kept warm between calls: what a cold
# child compiled and tuned (FLA's autotuning results included) is merged there, so the timed parts that follow do
# not compile it again. The cold children themselves always start from new empty folders.
#
# Time per part (H200, 10 repeats; each repeat cycles >= 2 input sets, so a row costs about 31 executed calls):
# one-time costs dominate. FLA autotunes per head configuration (its keys include H, HV, and IS_VARLEN for the varlen
# row): 130-170 s per part; FlashQLA's TileLang JIT 180-280 s of row wall time per part; our backends compile in
# 10-35 s. Measured with every backend: cold (COLD_MODES=fwd) 159 s, hv8 478 s, hv64 473 s; hv32 with FlashQLA needs
# a call of its own, or PROD_MODES=fwd and PROD_MODES=fwdbwd in two calls. The whole table with every peer is about
# 27 device minutes on one H200 with machine start and wheels: on a two-GPU machine run two parts side by side, one
# per GPU (CUDA_VISIBLE_DEVICES=0 / 1, each part's OUT apart), then merge.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT"
PART="${1:-hv32}"

if [ "$PART" = "merge" ]; then
    shift
    python -m linattn.cli bench --from-json "$@" --json "$OUT/gdn_production.json" --plot "$OUT/gdn_production.png"
    exit 0
fi
case "$PART" in hv32|hv64|hv8|cold) ;; *) echo "usage: $0 hv32|hv64|hv8|cold|merge FILES..." >&2; exit 2 ;; esac
CACHE_ROOT="${BENCH_CACHE:-/tmp/linattn-bench-cache}"
export TRITON_CACHE_DIR="$CACHE_ROOT/triton_cache_dir" TORCHINDUCTOR_CACHE_DIR="$CACHE_ROOT/torchinductor_cache_dir" \
       TILELANG_CACHE_DIR="$CACHE_ROOT/tilelang_cache_dir"
mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR" "$TILELANG_CACHE_DIR"

python -c "import linattn" 2>/dev/null || pip install -q --no-deps -e .
BACKENDS="triton gluon fla sdpa"
if python -c "import flash_qla" 2>/dev/null; then BACKENDS="triton gluon fla flashqla sdpa"; fi
COLD_FLAG="--no-cold"
if [ "${COLD:-0}" = "1" ]; then COLD_FLAG="--cold"; fi
PRESET="production_$PART"
MODES="${PROD_MODES:-fwd fwdbwd}"
# PROD_MODES / PROD_BACKENDS narrow one call (e.g. PROD_MODES=fwd PROD_BACKENDS="triton gluon fla flashqla": the
# forward against FlashQLA inside one 10-minute call; the fwd+bwd rows in another call)
BACKENDS="${PROD_BACKENDS:-$BACKENDS}"
# COLD_MODES="fwd": only the first call of each backend (the fwd+bwd cold runs of FLA and FlashQLA cost about 150 s
# each: both modes take about 467 s, fwd alone about 113 s of that)
if [ "$PART" = "cold" ]; then COLD_FLAG="--cold-only"; PRESET="production_hv32"; MODES="${COLD_MODES:-fwd fwdbwd}"; fi

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/nvidia_smi_$PART.txt"
python -m linattn.cli doctor | tee "$OUT/doctor_$PART.txt"
start=$(date +%s)
python -m linattn.cli bench --op gated_delta_rule --preset "$PRESET" --backends $BACKENDS \
    --modes $MODES --repeats 10 $COLD_FLAG \
    --json "$OUT/gdn_production_$PART.json" --plot "$OUT/gdn_production_$PART.png" 2>&1 | tee "$OUT/bench_$PART.log"
echo "part $PART took $(( $(date +%s) - start )) s (estimate in this script's header)"
