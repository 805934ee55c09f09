#!/usr/bin/env bash
# One GPU session for the attention kernels: tests, sanitizers, benchmarks; logs under $OUT (or ./out).
#   bash packages/nanoqwen-kernels/bench/attention/run_on_gpu.sh [tests|sanitize|bench]...   (default: all)
set -u
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-model/src:packages/nanoqwen-kernels/src PYTHONUNBUFFERED=1
export NANOQWEN_REQUIRE_GPU=1
steps=${*:-tests bench sanitize}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
for step in $steps; do
  case $step in
    tests)
      timeout 150 python3 -m pytest -q -m "gpu and not slow" -p no:cacheprovider \
        packages/nanoqwen-kernels/tests/test_attention.py 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    sanitize)
      for tool in racecheck synccheck memcheck; do
        timeout 80 compute-sanitizer --tool "$tool" --error-exitcode 3 \
          python3 packages/nanoqwen-kernels/bench/attention/sanitize_attention.py > "$OUT/sanitize_$tool.log" 2>&1
        echo "$tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_attention' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
      done ;;
    bench)
      timeout 200 python3 packages/nanoqwen-kernels/bench/attention/bench_attention.py --out "$OUT/bench.json" ${BENCH_ARGS:-} \
        2>&1 | tee "$OUT/bench.log" | tail -20 ;;
  esac
done
