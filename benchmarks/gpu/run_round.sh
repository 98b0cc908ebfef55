#!/usr/bin/env bash
# One GPU round on the device machine: install carried wheels, then run the named steps in order, each with its
# own time limit, all writing JSON under $OUT. Usage: bash benchmarks/gpu/run_round.sh STEP...
# Steps: fwd (forward gate + FLA timing), ncu (hardware counters of the forward's kernels), ncu_bwd (the same for
# one forward+backward, benchmarks/gpu/ncu_bwd.py; one case per call: NCU_BWD_CASES=triton:1:65536), bwd, decode, bench_decode (`linattn bench --modes decode`), decode_gluon, split (segment-parallel state pass),
# warmup (segment-parallel state pass with gate-truncated warm-ups, benchmarks/gpu/warmup_state_round.py),
# fused (the Triton forward's state pass and output as one kernel, benchmarks/gpu/fused_fwd_round.py), output (stage-4
# configs and variants, benchmarks/gpu/output_stage_round.py), bwd_wy (the opt-in WY backward v2,
# benchmarks/gpu/bwd_wy_round.py), bwd_local (the opt-in local backward v2, benchmarks/gpu/bwd_local_round.py),
# gluon_bwd_dh (the opt-in Gluon reverse state pass of the backward, LINATTN_GDN_GLUON_BWD_DH=1: gate vs the Triton
# kernel and vs fp64 with a per-case watchdog, then timing; benchmarks/gpu/gluon_bwd_dh_round.py, GLUON_BWD_DH_BUDGET
# seconds),
# gluon_fused_wu (the opt-in Gluon fused forward with W and U formed in the kernel, LINATTN_GDN_GLUON_FUSED_WU=1:
# gate with a per-case watchdog, then timing; benchmarks/gpu/gluon_fused_wu_round.py, GLUON_FUSED_WU_BUDGET seconds),
# gluon_fused_ws (the opt-in warp-specialised Gluon fused forward stages 3+4, LINATTN_GDN_GLUON_FUSED_WS=1: gate with a
# per-case watchdog, then timing; benchmarks/gpu/gluon_fused_ws_round.py, GLUON_FUSED_WS_BUDGET seconds), matmul,
# kkt_gva (the opt-in GVA form of stage 2a, intra_split.kkt_solve_gva_kernel: bit-equality with kkt_solve_kernel,
# then both timed; benchmarks/gpu/kkt_gva_round.py),
# kkt_v2 (the opt-in stage 2a v2, intra_split.kkt_solve_v2_kernel, Tinv by 16x16 block substitution: gcum equality and
# the Tinv error of both kernels vs an fp64 inverse, the forward with v2 vs fp64, then both timed;
# benchmarks/gpu/kkt_v2_round.py),
# kkt_v3 (stage 2a v3, the default since round 17, intra_split.kkt_solve_v3_kernel, v2 without tl.gather: kkt_v2's
# checks and timing for v1, v2 and v3 on the same rows, the forward with LINATTN_GDN_KKT=v3 vs fp64;
# benchmarks/gpu/kkt_v3_round.py),
# kkt_gluon (the opt-in Gluon stage 2a, gluon/kkt_solve.py, LINATTN_GDN_GLUON_KKT: each form vs the Triton kernel,
# gcum / Tinv equality and the Tinv error vs fp64, then timed; benchmarks/gpu/kkt_gluon_round.py),
# kkt_v4 (the opt-in stage 2a v4, intra_split.kkt_solve_v4_kernel, v3 with bf16 operands for the inverse's products
# where Tinv is stored in bf16: kkt_v2's checks and timing for v1, v3, v4o and v4, then the forward with v3 and v4 on
# the same inputs, CUDA graphs; benchmarks/gpu/kkt_v4_round.py),
# segments (the segment-parallel fused forward, LINATTN_GDN_GLUON_SEGMENTS=1, against the unsegmented one on the same
# inputs at fast, slow and mixed decay; benchmarks/gpu/segments_round.py),
# gluon (the Gluon GDN forward's gate and timing,
# benchmarks/gpu/gdn_gluon_round.py), bench, demo, and the production bench's parts
# prod_cold, prod_hv32, prod_hv64, prod_hv8 (benchmarks/gpu/bench_production.sh; one or two per call), and
# prod_par: the parts named in PROD_PARTS side by side, one per GPU (two calls on nvidia-h200-x2 give the whole
# table: PROD_PARTS="cold hv64", then PROD_PARTS="hv32 hv8" while the machine is warm).
# Wheels: every carried folder .whl* is installed into /tmp/site once per machine (a marker per wheel), so a
# second call on a warm machine can bring what did not fit in the first (FlashQLA's z3-solver in .whl2).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for w in .whl*/*.whl; do
  [ -e "$w" ] || continue
  mark=/tmp/site/.installed_$(basename "$w")
  [ -e "$mark" ] && continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
    && touch "$mark" || echo "wheel install failed: $w"
done
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
# one set of JIT caches for every step and call on this machine (bench_production.sh documents why)
C=${LINATTN_BENCH_CACHE:-/tmp/linattn-bench-cache}
export TRITON_CACHE_DIR=$C/triton_cache_dir TORCHINDUCTOR_CACHE_DIR=$C/torchinductor_cache_dir TILELANG_CACHE_DIR=$C/tilelang_cache_dir
# a snapshot made by snap.sh names its commit: take it, and refuse a LINATTN_COMMIT that says otherwise
if [ -f SNAP_COMMIT ]; then
  snap=$(cat SNAP_COMMIT)
  if [ -n "${LINATTN_COMMIT:-}" ] && [ "${LINATTN_COMMIT:0:7}" != "${snap:0:7}" ]; then
    echo "run_round.sh: LINATTN_COMMIT=$LINATTN_COMMIT but this snapshot is of $snap: make it with snap.sh" >&2
    exit 2
  fi
  export LINATTN_COMMIT=$snap
fi
if [ ! -f SNAP_COMMIT ]; then
  # a checkout, not a snapshot: the device copies the working tree but can keep a stale .git (round 27 part D: a run
  # of d3c7a8f's tree labelled 73bac74 by `git rev-parse HEAD` there), so check the label against the tree
  want=${LINATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
  git diff --quiet "$want" -- . 2>/dev/null; rc=$?
  if [ $rc = 1 ]; then
    echo "run_round.sh: the tree here differs from commit $want (the device's .git may be stale): labelled $want+tree-differs" >&2
    want="$want+tree-differs"
  elif [ $rc != 0 ]; then
    echo "run_round.sh: commit $want is not in this .git (a stale copy?): labelled $want+unverified" >&2
    want="$want+unverified"
  fi
  export LINATTN_COMMIT=$want
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
BASE=$OUT
for step in "$@"; do
  echo "=== $step $(date +%T)"
  # The device returns at most 8 files from $OUT: with PACK=1 each step writes into its own folder, packed into
  # $OUT/<step>.tgz as soon as the step ends (a call cut short still returns the steps it finished)
  if [ "${PACK:-0}" = "1" ]; then OUT=$BASE/$step; mkdir -p "$OUT"; fi
  case $step in
    # GATE_FLA= (empty) runs the forward and backward gates without FLA's errors and timing (saves ~2 min)
    fwd)    timeout 300 python3 benchmarks/gpu/gdn_fwd_gate.py --out "$OUT" ${GATE_FLA---fla} ;;
    bwd)    timeout 300 python3 benchmarks/gpu/gdn_bwd_gate.py --out "$OUT" ${GATE_FLA---fla} ;;
    decode) timeout 200 python3 benchmarks/gpu/decode_gate.py --out "$OUT" --fla ;;
    bench_decode) timeout 300 python3 -m linattn.cli bench --modes decode ${DECODE_BENCH_BACKENDS:+--backends $DECODE_BENCH_BACKENDS} --json "$OUT/decode_bench.json" ;;   # issue 6's targets: linattn bench --modes decode, same run as FLA
    matmul) timeout 240 python3 benchmarks/gpu/matmul_gate.py --out "$OUT" ;;
    decode_gluon) timeout 150 python3 benchmarks/gpu/decode_gluon_round.py --out "$OUT" ;;
    split)  timeout 200 python3 benchmarks/gpu/split_state_round.py --out "$OUT" ;;
    # segment warm-up (SEGMENT_WARMUP.md); its gate alone took 130 s on an H200 in round 13, so the timing rows need
    # WARMUP_BUDGET of about 240
    warmup) timeout $(( ${WARMUP_BUDGET:-140} + 60 )) python3 benchmarks/gpu/warmup_state_round.py --out "$OUT" --budget ${WARMUP_BUDGET:-140} ;;
    fused)  timeout 200 python3 benchmarks/gpu/fused_fwd_round.py --out "$OUT" ;;   # fused stage 3+4 (FUSED_FWD.md)
    output) timeout 150 python3 benchmarks/gpu/output_stage_round.py --out "$OUT" ;;   # stage-4 configs (OUTPUT_STAGE.md)
    bwd_local) timeout 160 python3 benchmarks/gpu/bwd_local_round.py --out "$OUT" ;;   # opt-in local backward v2 (BWD_LOCAL_V2.md)
    bwd_wy) timeout 160 python3 benchmarks/gpu/bwd_wy_round.py --out "$OUT" ;;   # opt-in WY backward v2 (BWD_WY_V2.md)
    gluon_fused_ws) timeout $(( ${GLUON_FUSED_WS_BUDGET:-150} + 60 )) python3 benchmarks/gpu/gluon_fused_ws_round.py --out "$OUT" --budget ${GLUON_FUSED_WS_BUDGET:-150} ;;   # warp-specialised Gluon fused stages 3+4 (GLUON_FUSED_WS.md)
    gluon_fused_wu) timeout $(( ${GLUON_FUSED_WU_BUDGET:-180} + 60 )) python3 benchmarks/gpu/gluon_fused_wu_round.py --out "$OUT" --budget ${GLUON_FUSED_WU_BUDGET:-180} ;;   # fused stages 2b+3+4, W/U on the fly (GLUON_FUSED_WU.md)
    gluon_bwd_dh) timeout $(( ${GLUON_BWD_DH_BUDGET:-150} + 60 )) python3 benchmarks/gpu/gluon_bwd_dh_round.py --out "$OUT" --budget ${GLUON_BWD_DH_BUDGET:-150} ;;   # Gluon backward state pass (GLUON_BWD_DH.md)
    gluon_warmup) timeout $(( ${GLUON_WARMUP_BUDGET:-150} + 60 )) python3 benchmarks/gpu/gluon_warmup_round.py --out "$OUT" --budget ${GLUON_WARMUP_BUDGET:-150} ;;   # segment warm-up on the Gluon state pass (GLUON_WARMUP.md)
    split_intra) timeout 150 python3 benchmarks/gpu/split_intra_round.py --out "$OUT" ;;   # two-kernel stage 2 (SPLIT_INTRA.md)
    kkt_gva) timeout 150 python3 benchmarks/gpu/kkt_gva_round.py --out "$OUT" ;;   # GVA stage 2a, K K^T once per key head (intra_split.py)
    kkt_v2) timeout 150 python3 benchmarks/gpu/kkt_v2_round.py --out "$OUT" ;;   # stage 2a v2, Tinv by 16x16 block substitution (intra_split.py)
    segments) timeout ${SEG_TIMEOUT:-300} python3 benchmarks/gpu/segments_round.py --out "$OUT" ;;   # segment-parallel forward vs unsegmented, same inputs (fast / slow / mixed decay; SEG_KIND=gf: the gate-free segment launch)
    segments_tl) timeout 200 python3 benchmarks/gpu/segments_round.py --out "$OUT" --timeline ;;   # kernel timelines, profiler
    host_profile) timeout 200 python3 benchmarks/gpu/host_profile.py --out "$OUT" ;;   # eager host time per call and its cProfile (HOST_ROWS)
    kkt_v3) timeout 150 python3 benchmarks/gpu/kkt_v3_round.py --out "$OUT" ;;   # stage 2a v1/v2/v3 on the same rows; v3 = v2 without tl.gather (intra_split.py)
    switch_ab) timeout $(( ${SWITCH_AB_BUDGET:-150} + 90 )) python3 benchmarks/gpu/switch_ab_round.py --out "$OUT" --budget ${SWITCH_AB_BUDGET:-150} ;;   # one env switch A/B on the forward (AB_SIDES, AB_ROWS)
    kkt_v4) timeout 330 python3 benchmarks/gpu/kkt_v4_round.py --out "$OUT" ;;   # stage 2a v1/v3/v4o/v4 (v4: bf16 product operands), then the forward with v3 vs v4 (A/B, KKT_V4_AB_BUDGET)
    kkt_gluon) timeout $(( ${KKT_GLUON_BUDGET:-150} + 90 )) python3 benchmarks/gpu/kkt_gluon_round.py --out "$OUT" --budget ${KKT_GLUON_BUDGET:-150} ;;   # the Gluon stage 2a (gluon/kkt_solve.py) forms vs the Triton kernel: checks, then timing
    gluon)  timeout $(( ${GLUON_BUDGET:-170} + 60 )) python3 benchmarks/gpu/gdn_gluon_round.py --out "$OUT" --budget ${GLUON_BUDGET:-170} --variants ${GLUON_VARIANTS:-wgmma,tma,literal} ;;
    profile) timeout 200 python3 benchmarks/gpu/profile_fwd.py --out "$OUT" --fla ;;
    bench)  timeout 300 bash benchmarks/gpu/bench_production.sh ;;
    prod_par)
            # production parts side by side, one per GPU (machine kind nvidia-h200-x2 or larger): part i of
            # PROD_PARTS runs on GPU i with its own JIT caches (/tmp/linattn-bench-cache-gpu<i>), so a later call
            # that runs hv32 on GPU 0 after `cold` there reuses what the cold children compiled. Every ratio is
            # still measured on one GPU (each part times all its backends on its own GPU); the parts only share
            # the host's CPUs. Round 11 timed each part alone: cold (fwd) 159 s, hv8 478 s, hv64 473 s.
            python3 -c "import flash_qla" 2>&1 | tail -1
            ngpu=$(nvidia-smi -L | wc -l); i=0; pids=""
            for part in ${PROD_PARTS:-cold hv64}; do
              gpu=$(( i % ngpu ))
              ( export CUDA_VISIBLE_DEVICES=$gpu LINATTN_BENCH_CACHE=/tmp/linattn-bench-cache-gpu$gpu
                timeout ${PROD_TIMEOUT:-570} bash benchmarks/gpu/bench_production.sh $part > "$OUT/lane_${part}.log" 2>&1
                echo "lane $part (GPU $gpu) exit $? $(date +%T)" ) &
              pids="$pids $!"; i=$((i + 1))
            done
            wait $pids
            for part in ${PROD_PARTS:-cold hv64}; do grep -a -v "TileLang\|Warning\|vectoriz\|Initialize the buffer\|dk_fragment\|^  -->\|^\s*$" "$OUT/lane_${part}.log" | tail -80; done ;;
    prod_cold|prod_hv32|prod_hv64|prod_hv8)
            python3 -c "import flash_qla" 2>&1 | tail -1
            timeout ${PROD_TIMEOUT:-570} bash benchmarks/gpu/bench_production.sh ${step#prod_} ;;
    ncu)    # hardware counters of one forward per (backend, shape): benchmarks/gpu/ncu_fwd.py (NCU_CASES to change;
            # 2 files per case: use PACK=1)
            NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
            if [ -z "$NCU" ]; then echo "ncu not found"; else
              for c in ${NCU_CASES:-triton:1:65536 gluon:1:65536 fla:1:65536 triton:8:4096}; do
                IFS=: read -r be b t <<< "$c"
                timeout 120 "$NCU" --clock-control none --profile-from-start off --csv --page details \
                  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
                  python3 benchmarks/gpu/ncu_fwd.py run --backend $be --B $b --T $t > "$OUT/ncu_${be}_B${b}_T${t}.csv" 2> "$OUT/ncu_${be}_B${b}_T${t}.err"
                echo "ncu $c exit $?"; tail -3 "$OUT/ncu_${be}_B${b}_T${t}.err"
              done
              python3 benchmarks/gpu/ncu_fwd.py summarize --out "$OUT" "$OUT"/ncu_*.csv
            fi ;;
    decode_inplace) timeout 240 python3 benchmarks/gpu/decode_inplace_round.py --out "$OUT" ;;   # round 29: discard_l2 vs default (bit-equal), in place vs out of place vs torch's copy / in-place scale (DECODE_INPLACE.md)
    ncu_decode) # DRAM / L2 bytes of each decode mode and of torch's 512 MiB copy and in-place scale (decode_inplace_round.py
            # --ncu-child); a second pass with the L2 fabric metrics, which may not exist under these names
            NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
            if [ -z "$NCU" ]; then echo "ncu not found"; else
              m=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sector_op_read_hit_rate.pct,lts__t_sector_op_write_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active
              timeout 150 "$NCU" --clock-control none --profile-from-start off --csv --metrics $m \
                python3 benchmarks/gpu/decode_inplace_round.py --ncu-child > "$OUT/ncu_decode.csv" 2> "$OUT/ncu_decode.err"
              echo "ncu_decode exit $?"; tail -3 "$OUT/ncu_decode.err"
              timeout 120 "$NCU" --clock-control none --profile-from-start off --csv \
                --metrics lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_tex.sum,lts__t_requests_srcunit_tex_op_write.sum \
                python3 benchmarks/gpu/decode_inplace_round.py --ncu-child > "$OUT/ncu_decode_fabric.csv" 2> "$OUT/ncu_decode_fabric.err"
              echo "ncu_decode fabric exit $?"; tail -3 "$OUT/ncu_decode_fabric.err"
              "$NCU" --query-metrics --chip gh100 2>&1 | grep -E "^(lts__t_sectors_srcunit|lts__t_sectors_op|ltcfabric|dram__bytes|lts__t_requests_srcunit)" > "$OUT/ncu_metric_names.txt"
            fi ;;
    ncu_src_decode) # where the warps of the persistent decode kernel wait, per SASS instruction: the first matching
            # launch of decode_inplace_round.py --ncu-child (the default, pool in place, batch 256); ncu_source.py
            # summarizes it (PACK=1: 3 files)
            NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
            if [ -z "$NCU" ]; then echo "ncu not found"; else
              rep="$OUT/ncusrc_decode_default"
              timeout 200 "$NCU" --clock-control none --profile-from-start off -k "regex:fused_recurrent_gdn_fwd_persistent" \
                --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight -o "$rep" -f \
                python3 benchmarks/gpu/decode_inplace_round.py --ncu-child > "$rep.log" 2>&1
              echo "ncu_src_decode profile exit $?"; tail -3 "$rep.log"
              "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass > "${rep}_sass.csv" 2> "${rep}_sass.err"
              echo "ncu_src_decode source page exit $? ($(wc -c < "${rep}_sass.csv") bytes)"
              "$NCU" -i "$rep.ncu-rep" --page details --csv > "${rep}_details.csv" 2> /dev/null
              [ "$(wc -c < "${rep}_sass.csv")" -gt 1000 ] && rm -f "$rep.ncu-rep" "$rep.log"
              python3 benchmarks/gpu/ncu_source.py --out "$OUT" "${rep}_sass.csv"
            fi ;;
    ncu_src) # where the warps wait, per SASS instruction, in the kernels matching NCU_KERNEL (default: the fused
            # forward kernel) of one forward per case: SourceCounters + WarpStateStats into a report, exported as the
            # source page (SASS) and the raw page; benchmarks/gpu/ncu_source.py summarizes the SASS CSV. 4 files per
            # case: use PACK=1
            NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
            if [ -z "$NCU" ]; then echo "ncu not found"; else
              for c in ${NCU_CASES:-gluon:1:65536}; do
                IFS=: read -r be b t <<< "$c"
                rep="$OUT/ncusrc_${be}_B${b}_T${t}"
                timeout ${NCU_SRC_TIMEOUT:-200} "$NCU" --clock-control none --profile-from-start off \
                  -k "regex:${NCU_KERNEL:-fused}" --section SourceCounters --section WarpStateStats \
                  --section SpeedOfLight --section LaunchStats -o "$rep" -f \
                  python3 benchmarks/gpu/ncu_fwd.py run --backend $be --B $b --T $t > "$rep.log" 2>&1
                echo "ncu_src $c profile exit $?"; tail -3 "$rep.log"
                "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass > "${rep}_sass.csv" 2> "${rep}_sass.err" \
                  || "$NCU" -i "$rep.ncu-rep" --page source --csv > "${rep}_sass.csv" 2>> "${rep}_sass.err"
                echo "ncu_src $c source page exit $? ($(wc -c < "${rep}_sass.csv") bytes)"; tail -2 "${rep}_sass.err"
                "$NCU" -i "$rep.ncu-rep" --page raw --csv > "${rep}_raw.csv" 2> /dev/null
                echo "ncu_src $c raw page exit $?"
                # the report is tens of MB; the two pages carry what the summaries read. Kept when the source page
                # came out (nearly) empty, so the export can be retried by hand on this machine
                [ "$(wc -c < "${rep}_sass.csv")" -gt 1000 ] && rm -f "$rep.ncu-rep"
              done
              python3 benchmarks/gpu/ncu_source.py --out "$OUT" "$OUT"/ncusrc_*_sass.csv
            fi ;;
    ncu_bwd) # hardware counters of one forward+backward per (backend, shape): benchmarks/gpu/ncu_bwd.py
            # (NCU_BWD_CASES to change; the backward replays about twice the forward's kernels: one case per call)
            NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
            if [ -z "$NCU" ]; then echo "ncu not found"; else
              for c in ${NCU_BWD_CASES:-triton:1:65536 fla:1:65536}; do
                IFS=: read -r be b t <<< "$c"
                timeout ${NCU_BWD_TIMEOUT:-280} "$NCU" --clock-control none --profile-from-start off --csv --page details \
                  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
                  python3 benchmarks/gpu/ncu_bwd.py run --backend $be --B $b --T $t ${NCU_BWD_PHASE:+--phase $NCU_BWD_PHASE} \
                  > "$OUT/ncubwd_${be}_B${b}_T${t}.csv" 2> "$OUT/ncubwd_${be}_B${b}_T${t}.err"
                echo "ncu_bwd $c exit $?"; tail -3 "$OUT/ncubwd_${be}_B${b}_T${t}.err"
              done
              python3 benchmarks/gpu/ncu_bwd.py summarize --out "$OUT" "$OUT"/ncubwd_*.csv
            fi ;;
    demo)   timeout 120 python3 -m linattn.cli demo 2>&1 | tee "$OUT/demo.txt" ;;
    imports) python3 -c "import torch, triton, fla, linattn; print('fla', fla.__version__)"; python3 -c "import flash_qla; print('flash_qla', flash_qla.__version__)" 2>&1 | tail -1 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "=== $step exit $? $(date +%T)"
  if [ "${PACK:-0}" = "1" ]; then tar czf "$BASE/$step.tgz" -C "$BASE" "$step" && rm -rf "${BASE:?}/$step"; OUT=$BASE; fi
done
