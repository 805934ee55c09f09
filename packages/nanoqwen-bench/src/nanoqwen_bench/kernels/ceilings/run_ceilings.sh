#!/usr/bin/env bash
# The decode-ceiling measurements in one device call (nanoqwen_bench.kernels.decode_ceilings):
#   bash packages/nanoqwen-bench/src/nanoqwen_bench/kernels/ceilings/run_ceilings.sh [main|ncu|all]     (writes under $OUT)
# main: decode_ceilings.py's default mode (launch cost, streaming and compute ceilings, SASS counts, the
#       decode graph's replay and CUPTI timeline), ~2-4 min.
# ncu:  the decode graph under ncu (per-node durations), the four GEMVs under ncu (stall reasons), then
#       --ncu-summary, which merges into ceilings.json when main ran in the same $OUT. ~3-4 min.
# At most 8 files come back from $OUT: the reports stay at the top, the rest is packed in raw.tar.gz.
set -o pipefail
mode=${1:-all}
OUT=${OUT:-ceilings_out}
mkdir -p "$OUT/raw"
PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
export PYTHONPATH PYTHONUNBUFFERED=1 NANOQWEN_KERNEL_CACHE=/tmp/nq_kernel_cache
S="-m nanoqwen_bench.kernels.decode_ceilings"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/raw/smi.txt"
status=0
if [ "$mode" != ncu ]; then
  timeout 300 python3 $S --out "$OUT" 2>&1 | tee "$OUT/main.log" || status=1
fi
if [ "$mode" != main ]; then
  NCU="ncu --clock-control none --print-units base"
  timeout 240 $NCU --cache-control none --graph-profiling node --profile-from-start off \
    --metrics gpu__time_duration.sum -f -o "$OUT/raw/ncu-timeline" \
    python3 $S --ncu-target --out "$OUT" >"$OUT/raw/ncu-timeline.log" 2>&1 || status=1
  tail -3 "$OUT/raw/ncu-timeline.log"
  ncu --print-units base -i "$OUT/raw/ncu-timeline.ncu-rep" --page details --csv >"$OUT/ncu-timeline.csv" || status=1
  for s in qkv o gate_up down; do
    timeout 120 $NCU --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section Occupancy --section LaunchStats -k regex:gemv_int4 --launch-skip 2 --launch-count 1 \
      -f -o "$OUT/raw/ncu-gemv-$s" python3 $S --gemv-target $s >"$OUT/raw/ncu-gemv-$s.log" 2>&1 || status=1
    tail -2 "$OUT/raw/ncu-gemv-$s.log"
    ncu -i "$OUT/raw/ncu-gemv-$s.ncu-rep" --page details >"$OUT/raw/ncu-gemv-$s.txt" || status=1
    ncu --print-units base -i "$OUT/raw/ncu-gemv-$s.ncu-rep" --page raw --csv >"$OUT/ncu-gemv-$s-raw.csv" || status=1
  done
  python3 $S --ncu-summary "$OUT" || status=1
fi
# pack everything but the reports (the ncu CSVs and ncu_target.json too: --ncu-summary can be rerun on them)
cd "$OUT" && mv -f ncu-*.csv ncu_target.json raw/ 2>/dev/null
tar czf raw.tar.gz raw && rm -rf raw
ls -la
exit $status
