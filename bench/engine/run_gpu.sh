#!/usr/bin/env bash
# One device call for the CUDA engine: GPU tests, then the benchmark. Logs and results go to $OUT
# (at most 8 files come back: gpu_tests.log, bench.log, bench/{bench.json,bench.md,*.png}).
#   run from the repo root on the GPU machine:  bash bench/engine/run_gpu.sh
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-model/src:packages/nanoqwen-kernels/src:packages/nanoqwen-runtime/src:packages/nanoqwen-cli/src
export NANOQWEN_REQUIRE_GPU=1
OUT=${OUT:-/tmp/engine-out}
mkdir -p "$OUT/bench"
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; python3 -c "import torch, cupy; print(torch.__version__, cupy.__version__)"; } 2>&1 | tee "$OUT/bench.log"
# benchmark first (the deliverable with numbers), then the agreement/reliability tests
[ -n "${SKIP_BENCH:-}" ] || timeout ${BENCH_TIMEOUT:-210} python3 -m nanoqwen_cli.main bench --out "$OUT/bench" --load-test /tmp ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -s -m gpu -p no:cacheprovider packages/nanoqwen-runtime/tests/test_engine_gpu.py ${TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
echo "tests rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.log"
# `nanoqwen-cli generate --device cuda --backend engine` on a tiny INT4 container with a real tokenizer
python3 -c "
from nanoqwen_runtime.testing import write_tiny_container
write_tiny_container('/tmp/tiny-cli.nanoqwen', method='rtn', seed=1, config_overrides=dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512))
" 2>&1 | tee "$OUT/cli.log"
timeout ${CLI_TIMEOUT:-90} python3 -m nanoqwen_cli.main generate /tmp/tiny-cli.nanoqwen --prompt "def fib(n):" \
    --max-tokens 24 --device cuda --backend engine 2>&1 | tee -a "$OUT/cli.log"
echo "cli rc=${PIPESTATUS[0]}" | tee -a "$OUT/cli.log"
