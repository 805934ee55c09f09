# one device call: the int8 build against the default (gemv_ab.py), each side checked before timing
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
F=$PWD/packages/nanoqwen-format/src:$PWD/packages/nanoqwen-model/src:$PWD/packages/nanoqwen-kernels/src
AB=bench/kernels/gemv_ab.py; mkdir -p $OUT/ab
run() { PYTHONPATH=$F timeout 150 python3 $AB time --with-lm-head "$@" 2>&1 | tail -3; }
run --label default --out $OUT/ab/default.json
run --label i8mma --variant gemv_i8mma --out $OUT/ab/i8mma.json
run --label i8mma_staged --variant gemv_i8mma_staged --out $OUT/ab/i8mma_staged.json
run --label i8mma_exact --variant gemv_i8mma_exact --out $OUT/ab/i8mma_exact.json
run --label i8mma_t3 --variant gemv_i8mma_staged --target-blocks 3 --out $OUT/ab/i8mma_t3.json
for f in i8mma i8mma_staged i8mma_exact i8mma_t3; do PYTHONPATH=$F python3 $AB compare $OUT/ab/default.json $OUT/ab/$f.json --out $OUT/ab/$f.md; done
cat $OUT/ab/i8mma.md $OUT/ab/i8mma_staged.md
