# One device call (session 26): the int8 GEMV builds against the default build, bench/kernels/gemv_ab.py,
# each side's output checked against its fp32 reference before it is timed; then an A/A of the default.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
F=$PWD/packages/nanoqwen-format/src:$PWD/packages/nanoqwen-model/src:$PWD/packages/nanoqwen-kernels/src
AB=bench/kernels/gemv_ab.py; mkdir -p $OUT/ab
# MS: the row counts to time (default 1,8; e.g. MS=1,2,4,8 for the int8 loop's crossover: gemv_build int8-m1)
run() { PYTHONPATH=$F timeout 120 python3 $AB time --with-lm-head --ms ${MS:-1,8} "$@" 2>&1 | tail -2; }
run --label default --out $OUT/ab/default.json
run --label i8mma_staged --variant gemv_i8mma_staged --out $OUT/ab/i8mma_staged.json
run --label i8mma --variant gemv_i8mma --out $OUT/ab/i8mma.json
run --label default_aa --out $OUT/ab/default_aa.json
for f in i8mma_staged i8mma default_aa; do
  PYTHONPATH=$F python3 $AB compare $OUT/ab/default.json $OUT/ab/$f.json --out $OUT/ab/$f.md >/dev/null; done
cat $OUT/ab/i8mma_staged.md; grep -i "geomet" $OUT/ab/*.md
