"""The engine benchmark behind `nanoqwen-cli bench` (and `nox -s bench`): end-to-end numbers on one GPU.

Everything is measured in one run, on one model (synthetic Qwen2.5-Coder-7B geometry built on the
GPU, or a given .nanoqwen file):

- read bandwidth: a kernel that only reads a 4 GiB buffer (nanoqwen_bench.gpu.read_bandwidth),
  median of 30 launches: the roofline of every decode number below is this bandwidth over the bytes
  one step must read. The device-to-device copy bandwidth (2 GiB, bytes read + written) is measured
  beside it and reported, but it is no ceiling for a step that only reads;
- GPU memory: `Engine.memory_report()` (container tensors, weights on the GPU with the bf16 dense
  cache, KV pool, workspace, graph pool, torch's peak allocation);
- decode tok/s at batch 1 for contexts 128 / 4K / 32K (graph mode), with the GPU time of the graph
  replay alone (CUDA events) beside the engine's wall time (which adds the host: scheduling, step
  inputs, the token read-back), and the bytes each token must read;
- aggregate decode tok/s at batch 1 / 8 / 32 / 64 (context 128 + generated);
- prefill tok/s for 512- and 4096-token prompts; time to first token for a 2K prompt;
- graph versus eager at batch 1 and 8;
- prefix cache (`prefix_cache_ttft`): the time to first token of a request sharing a 4K-token prefix
  with an earlier one against the cold time (goal: at most 15% of it), and the cache's hit tokens;
- the time of each op and kernel of an eager batch-1 decode step from CUDA events
  (`bench_profile.py`; no torch.profiler), their bytes and bandwidth against the read roofline, the
  launches per step, and their sum against the graph's replay time.

Prefix caching and prompt-lookup speculation (k = 4) are ON in every section by default, as a user
gets them: on the random prompts here nothing is reused (each section's prompts are drawn with their
own seed), so the figures show what the features cost when they do not help; the engine's counters
(`EngineStats`) after the decode sections are reported (`engine_stats`) to show how much was drafted
and hit. `features=False` (`nanoqwen-cli bench --features-off`) runs the same sections with both off.
With the features on, `features_cost` then measures the no-regression goal in the same run: two engines
on the same weights, one with both features and one without, decode tok/s at batch 1/8/32/64 measured
alternately; a regression is every "on" repeat slower than every "off" repeat (`ab_decode`). With
the synthetic model, `layout_speed` compares the default layout (g128 asym) with g128 sym the same way,
and the engine options are compared with their defaults (`overlap_ab`), as is an INT4
lm_head with the bf16 one (`lm_head_ab`, each side's fraction of the read roofline). `only`
(`nanoqwen-cli bench --only a,b`) runs just the named sections.

Results: bench.json and bench.md (`bench_report.py` builds both from the raw numbers collected here;
they are rewritten after every section, so a run cut short keeps what it measured) and two plots.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from nanoqwen_model import QWEN25_CODER_7B, QWEN25_CODER_GEOMETRIES, Qwen2Config
from nanoqwen_runtime.engine.config import EngineConfig
from nanoqwen_runtime.engine.engine import Engine, FinishEvent, TokenEvent
from nanoqwen_runtime.engine.scheduler import Request
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.speculative import SpeculationConfig

from .bench_report import build_report, write_report

Log = Callable[[str], None]


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of `reps`."""
    a = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(3):
        b.copy_(a)
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times)


def tokenizer_from(path: Path):
    """The tokenizer of a .nanoqwen container, or of a tokenizer.json (the synthetic model's benches
    that need real text or a grammar)."""
    from nanoqwen_runtime import Tokenizer

    return Tokenizer.from_json(path.read_text()) if path.suffix == ".json" else Tokenizer.from_file(path)


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 150000), (n,), generator=g).tolist()


def engine_of(model: str | None, cfg: EngineConfig) -> tuple[Engine, str]:
    """The engine of a .nanoqwen container, or (None) of the synthetic Qwen2.5-Coder-7B geometry (random
    INT4 g128 asymmetric weights, as `run_bench`), and how a result names it."""
    if model:
        return Engine.from_file(model, cfg), model
    from nanoqwen_runtime.engine.synthetic import random_weights

    weights = random_weights(QWEN25_CODER_7B, torch.device("cuda"), seed=0, symmetric=False)
    return Engine(QWEN25_CODER_7B, weights, cfg), "synthetic Qwen2.5-Coder-7B geometry"


def _run(engine: Engine, requests: list[Request]) -> tuple[dict[str, FinishEvent], list[tuple]]:
    """Run to completion with a step log: (kind, rows, seconds) per step."""
    log = []
    fins = {}
    for r in requests:
        ev = engine.submit(r)
        if ev is not None:
            raise RuntimeError(f"bench request refused: {ev.detail}")
    while engine.has_work:
        kinds = engine.num_steps.copy()
        t0 = time.perf_counter()
        evs = engine.step()
        dt = time.perf_counter() - t0
        # the kind of the step whose events came back (with overlap, the step this call queued is the
        # next one)
        kind = engine.last_step_kind if evs else ("decode" if engine.num_steps["decode"] > kinds["decode"]
                                                  else "prefill")
        rows = sum(1 for e in evs if isinstance(e, TokenEvent))
        log.append((kind, rows, dt))
        for e in evs:
            if isinstance(e, FinishEvent):
                fins[e.request_id] = e
    return fins, log


def _decode_rate(log, skip: int = 3) -> float:
    """Generated tokens per second over the decode steps (the first `skip` left out as warm-up)."""
    steps = [(r, dt) for k, r, dt in log if k == "decode"][skip:]
    return sum(r for r, _ in steps) / sum(dt for _, dt in steps)


def replay_time(engine: Engine, bucket: int, context: int, reps: int = 50) -> float:
    """Median GPU time (s) of one replay of the decode graph of `bucket` at `context` tokens, with the
    step buffers as the last step left them."""
    from nanoqwen_bench.gpu import median_replay_seconds

    return median_replay_seconds(engine.runner.graphs[(bucket, engine.runner.context_class(context))], reps)


def decode_at_context(engine: Engine, ctx: int, new: int, batch: int = 1, seed: int = 0) -> dict:
    """Prefill `batch` prompts of `ctx` tokens, decode `new` tokens each; rates and replay time."""
    vocab = engine.geom.vocab_size
    reqs = [Request(_prompt(ctx, vocab, seed + i), SamplingParams(max_tokens=new), f"c{ctx}b{batch}-{i}",
                    ignore_eos=True) for i in range(batch)]
    fins, log = _run(engine, reqs)
    out = {"context": ctx, "batch": batch, "new_tokens": new, "engine_tok_s": _decode_rate(log),
           "prefill_s": sum(dt for k, _, dt in log if k == "prefill"),
           "ttft_s": statistics.median(f.ttft_s for f in fins.values())}
    if engine.config.mode == "graph":
        # the graph of the last step, replayed with the buffers of that real step at this context
        bucket = engine.config.bucket_for(batch)
        out["graph_replay_s"] = replay_time(engine, bucket, ctx + new - 1)
        out["context_class"] = engine.runner.context_class(ctx + new - 1)
        out["graph_tok_s"] = batch / out["graph_replay_s"]
    return out


PREFILL_REPS = 3  # one n-token prefill is 4-120 ms on the H200: a single run moves by +-30%


def prefill_rate(engine: Engine, n: int, seed: int = 7, reps: int = PREFILL_REPS) -> dict:
    """Prefill of an n-token prompt, `reps` times with fresh prompts (no prefix-cache hit): the medians
    of the prefill steps' time and of the time to first token, the rate from the median time, and
    every repeat's figures."""
    times, ttfts = [], []
    for r in range(reps):
        rid = f"p{n}-{r}"
        fins, log = _run(engine, [Request(_prompt(n, engine.geom.vocab_size, seed + 1000 * r),
                                          SamplingParams(max_tokens=1), rid, ignore_eos=True)])
        times.append(sum(dt for k, _, dt in log if k == "prefill"))
        ttfts.append(fins[rid].ttft_s)
    t = statistics.median(times)
    return {"prompt": n, "prefill_s": t, "prefill_tok_s": n / t, "ttft_s": statistics.median(ttfts),
            "reps": reps, "prefill_s_all": times, "ttft_s_all": ttfts}


def prefix_cache_ttft(engine: Engine, prefix: int = 4096, tail: int = 64, reps: int = 3,
                      seed: int = 300) -> dict:
    """Time to first token of a request whose first `prefix` tokens an earlier request had (warm)
    against one whose prompt is new (cold), `reps` times with fresh prompts; medians, the warm/cold
    ratio (the issue's goal: <= 0.15) and the prefix-cache hit tokens of the warm requests."""
    if not engine.config.prefix_caching:
        raise RuntimeError("prefix caching is off in this engine (features off): nothing to measure")
    vocab = engine.geom.vocab_size
    # a model with a shorter context gets the longest whole-block prefix that fits (recorded)
    bs = engine.config.block_size
    prefix = min(prefix, (engine.max_model_len - tail - 1) // bs * bs)
    cold, warm, hits = [], [], []
    for r in range(reps):
        shared = _prompt(prefix, vocab, seed + 3 * r)
        a = shared + _prompt(tail, vocab, seed + 3 * r + 1)
        b = shared + _prompt(tail, vocab, seed + 3 * r + 2)
        fins, _ = _run(engine, [Request(a, SamplingParams(max_tokens=1), f"cold{r}", ignore_eos=True)])
        cold.append(fins[f"cold{r}"].ttft_s)
        before = engine.stats().prefix_hit_tokens
        fins, _ = _run(engine, [Request(b, SamplingParams(max_tokens=1), f"warm{r}", ignore_eos=True)])
        warm.append(fins[f"warm{r}"].ttft_s)
        hits.append(engine.stats().prefix_hit_tokens - before)
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prefix_tokens": prefix, "tail_tokens": tail, "reps": reps, "cold_ttft_s": c, "warm_ttft_s": w,
            "warm_over_cold": w / c, "goal_warm_over_cold": 0.15, "warm_hit_tokens": hits,
            "cold_ttft_all_s": cold, "warm_ttft_all_s": warm}


FEATURES_BATCHES = (1, 8, 32, 64)
PROFILE_BATCHES = (16, 32, 64)  # per-kernel decode profiles beside batch 1's: the INT4 GEMM's classes
# aggregate decode rows of the report: batch 1, the GEMV's largest batch, and the INT4 GEMM's classes
DECODE_BATCHES = (1, 8, 16, 32, 64)
# A/B verdicts are judged against the run's own noise, not a fitted margin: with `reps` alternating
# repeats per side, A is called slower than B only when every one of its repeats is slower than every
# repeat of B (a one-sided rank test with U = 0: under "no difference" that ordering has probability
# 1 / C(2 reps, reps) = 1/70 for 4 repeats). The medians' ratio and each side's spread go beside it.
AB_REPS = 4


def ab_decode(a: Engine, b: Engine, *, batches: tuple[int, ...], reps: int = AB_REPS, new: int = 128,
              ctx: int = 128, seed: int = 100_000) -> list[dict]:
    """Engine decode tok/s of engine `a` against engine `b` in one process, measured alternately (a, b,
    then b, a, ...) `reps` times per batch size so that drift hits both sides alike; fresh random
    prompts per repeat, never shared between repeats (nothing for a prefix cache to reuse).
    Per batch: medians, spreads ((max - min) / median), a/b and the rank-test verdict `a_slower`."""
    rows = []
    for batch in batches:
        rates: dict[str, list[float]] = {"a": [], "b": []}
        graph: dict[str, list[float]] = {"a": [], "b": []}
        for rep in range(reps):
            for side in (("a", "b") if rep % 2 == 0 else ("b", "a")):
                r = decode_at_context(a if side == "a" else b, ctx, new, batch=batch,
                                      seed=seed + 10_000 * rep + 100 * batch)
                rates[side].append(r["engine_tok_s"])
                if "graph_tok_s" in r:
                    graph[side].append(r["graph_tok_s"])
        med = {k: statistics.median(v) for k, v in rates.items()}
        rows.append({"batch": batch, "a_tok_s": med["a"], "b_tok_s": med["b"],
                     "a_over_b": med["a"] / med["b"],
                     "spread_a": (max(rates["a"]) - min(rates["a"])) / med["a"],
                     "spread_b": (max(rates["b"]) - min(rates["b"])) / med["b"],
                     "a_all": rates["a"], "b_all": rates["b"], "a_slower": max(rates["a"]) < min(rates["b"]),
                     # graph replay of each repeat's last step (None in eager mode)
                     "a_graph_tok_s": statistics.median(graph["a"]) if graph["a"] else None,
                     "b_graph_tok_s": statistics.median(graph["b"]) if graph["b"] else None})
    return rows


def _ab_engine(geom: Qwen2Config, weights, **cfg) -> Engine:
    return Engine(geom, weights, EngineConfig(kv_memory_bytes=4 << 30, max_model_len=4096, **cfg))


def features_cost(geom: Qwen2Config, weights, *, batches: tuple[int, ...] = FEATURES_BATCHES,
                  reps: int = AB_REPS) -> dict:
    """No regression from the features: decode with prefix caching + speculation (ngram:4) on (a)
    against both off (b), same weights, two graph-mode engines (4 GiB KV each), `ab_decode`.
    `regression` when any batch size's "on" is slower by the rank test."""
    on = _ab_engine(geom, weights, prefix_caching=True, speculation=SpeculationConfig(k=4))
    off = _ab_engine(geom, weights, prefix_caching=False, speculation=None)
    rows = ab_decode(on, off, batches=batches, reps=reps)
    stats = asdict(on.stats())
    del on, off
    torch.cuda.empty_cache()
    return {"rows": rows, "reps": reps, "context": 128, "new_tokens": 128, "on_engine_stats": stats,
            "regression": any(r["a_slower"] for r in rows)}


def layout_speed(geom: Qwen2Config, weights, *, batches: tuple[int, ...] = (1, 8),
                 reps: int = AB_REPS) -> dict:
    """Decode speed of the chosen default recipe against g128 sym: the run's weights (`weights`,
    asymmetric g128: the default recipe's layout, a uint8 zero point per group) (a) against symmetric
    g128 weights of the same geometry (b), features off on both, `ab_decode`; plus each side's weight
    bytes read per token."""
    from nanoqwen_runtime.engine.synthetic import random_weights

    sym = random_weights(geom, weights.embed_tokens.device, seed=0, symmetric=True)
    ea = _ab_engine(geom, weights, prefix_caching=False, speculation=None)
    eb = _ab_engine(geom, sym, prefix_caching=False, speculation=None)
    rows = ab_decode(ea, eb, batches=batches, reps=reps)
    out = {"rows": rows, "reps": reps, "a": "g128 asym (default)", "b": "g128 sym",
           "weight_bytes_a": sum(weights.decode_bytes().values()),
           "weight_bytes_b": sum(sym.decode_bytes().values())}
    del ea, eb, sym
    torch.cuda.empty_cache()
    return out


def lm_head_ab(geom: Qwen2Config, weights, *, batches: tuple[int, ...] = (1,),
               reps: int = AB_REPS) -> dict:
    """The batch-1 goal of 900 tok/s (80% of the roofline) with an int4 lm_head: the run's
    weights with an INT4 g128 asymmetric lm_head (a: what `nanoqwen-quant pack --lm-head int4` gives the
    decode step), against their bf16 lm_head (b), features off, `ab_decode` at context 128 + 128; each
    side's bytes per token at the last step's context (the report turns each side's graph replay into a
    fraction of the read roofline with them) and each side's batch-1 graph paths (the int4 side must run
    its lm_head as one more INT4 GEMV and no cuBLAS GEMM)."""
    import dataclasses

    from nanoqwen_runtime.engine.synthetic import random_int4

    device = weights.embed_tokens.device
    gen = torch.Generator(device=device).manual_seed(1)
    h = geom.hidden_size
    head = random_int4(geom.vocab_size, h, device, gen, 128, std=2.0 / h**0.5, symmetric=False)
    w4 = dataclasses.replace(weights, lm_head=head)
    ea = _ab_engine(geom, w4, prefix_caching=False, speculation=None)
    eb = _ab_engine(geom, weights, prefix_caching=False, speculation=None)
    rows = ab_decode(ea, eb, batches=batches, reps=reps)
    ctx = 128 + 128 - 1
    cls = ea.runner.context_class(ctx)
    out = {"rows": rows, "reps": reps, "a": "int4", "b": "bf16", "context": 128,
           "new_tokens": 128, "bytes_per_token_a": sum(bytes_per_token(ea, ctx).values()),
           "bytes_per_token_b": sum(bytes_per_token(eb, ctx).values()),
           "graph_paths_a": dict(ea.runner.graph_paths.get((1, cls), {})),
           "graph_paths_b": dict(eb.runner.graph_paths.get((1, cls), {}))}
    del ea, eb, w4, head
    torch.cuda.empty_cache()
    return out


OVERLAP_BATCHES = (1, 8, 64)


def overlap_ab(geom: Qwen2Config, weights, *, batches: tuple[int, ...] = OVERLAP_BATCHES,
               reps: int = AB_REPS) -> dict:
    """The goal "engine wall time at least 95% of the graph replay": `EngineConfig.overlap` on (a, the
    next decode step queued before the previous one is read back) against off (b), same weights,
    features off, `ab_decode` (engine tok/s, and each side's graph replay: the engine-over-graph ratio
    of each side is the host's share); plus the on-engine's decode steps and how many of them were
    planned ahead (the path that ran)."""
    on = _ab_engine(geom, weights, prefix_caching=False, speculation=None, overlap=True)
    off = _ab_engine(geom, weights, prefix_caching=False, speculation=None, overlap=False)
    rows = ab_decode(on, off, batches=batches, reps=reps)
    out = {"rows": rows, "reps": reps, "a": "overlap", "b": "off", "context": 128, "new_tokens": 128,
           "decode_steps_on": on.num_steps["decode"], "steps_ahead_on": on.num_steps_ahead,
           "steps_ahead_off": off.num_steps_ahead}
    del on, off
    torch.cuda.empty_cache()
    return out


def bytes_per_token(engine: Engine, ctx: int) -> dict[str, int]:
    """The bytes one batch-1 decode step at context `ctx` must move, by part (no total: the report sums)."""
    w = engine.weights.decode_bytes()
    w["kv"] = ctx * engine.geom.kv_bytes_per_token()
    w["logits_and_activations"] = engine.geom.vocab_size * 2 * 2  # logits written + read by the sampler
    return w


def memory(engine: Engine) -> dict:
    """`Engine.memory_report()` as a dict, with the weights-on-GPU total and the device's size; and the
    KV pool in tokens, with the tokens a bf16 dense weight cache would take from it (2 bytes per
    quantized weight, x `kv_memory_fraction` as `_size_pool` budgets): what running INT4 frees."""
    from nanoqwen_runtime.engine.ops_kernels import KernelOps

    m = engine.memory_report()
    free, total = torch.cuda.mem_get_info(engine.device)
    per_token = engine.geom.kv_bytes_per_token()
    dense_bytes = KernelOps.dense_cache_bytes(engine.weights)
    dense_tokens = int(dense_bytes * engine.config.kv_memory_fraction) // per_token
    return asdict(m) | {"weights_gpu_bytes": m.weights_gpu_bytes, "device_total_bytes": total,
                        "device_free_bytes": free, "kv_pool_tokens": m.kv_pool_bytes // per_token,
                        "kv_tokens_of_dense_cache": dense_tokens}


def load_time(geometry: Qwen2Config, folder: Path) -> dict:
    """Write a synthetic container of `geometry`, then time `loader.load` to the GPU (page cache warm:
    the file was just written) side by side: "plain" (verify=False, the CLI's --no-verify) and "verify"
    (the default: checksums hashed beside the copies, NaN/Inf check on the device). The file is removed
    afterwards."""
    from nanoqwen_runtime.engine.loader import load
    from nanoqwen_runtime.engine.synthetic import write_container

    path = folder / "synthetic-bench.nanoqwen"
    t0 = time.perf_counter()
    write_container(path, geometry, seed=1, device="cuda")
    write_s = time.perf_counter() - t0
    try:
        out = {"file_bytes": path.stat().st_size, "write_s": write_s}
        for verify in (False, True):
            torch.cuda.synchronize()
            m = load(path, "cuda", verify=verify)
            torch.cuda.synchronize()
            key = "verify" if verify else "plain"
            out[key] = asdict(m.stats) | {"upload_GBps": m.stats.gbps}
            del m
            torch.cuda.empty_cache()
        return out
    finally:
        path.unlink(missing_ok=True)


ALWAYS_RUN = ("read_bandwidth", "copy_bandwidth_Bps")  # the roofline of every figure: run under `only` too


class _Run:
    """The raw numbers of one run, the sections that fill them, and the report rewritten after each.
    only: the names of the sections to run (ALWAYS_RUN besides); None runs every section."""

    def __init__(self, out_dir: Path, log: Log, raw: dict, only: frozenset[str] | None = None):
        self.out_dir, self.log, self.raw, self.only = out_dir, log, raw, only
        self.names: list[str] = []  # every section the run reached, run or skipped

    def section(self, key: str, fn, *args, into: str | None = None, **kw):
        """Run one section; its result goes to raw[key] (or is appended to raw[into]). A failure is
        recorded under raw["errors"] (and logged), never hidden, and does not stop the other sections.
        A section that `only` leaves out returns None without running."""
        self.names.append(key)
        if self.only is not None and key not in self.only and key not in ALWAYS_RUN:
            return None
        try:
            res = fn(*args, **kw)
            if into is None:
                self.raw[key] = res
            else:
                self.raw.setdefault(into, []).append(res)
            return res
        except Exception as e:  # noqa: BLE001 - reported in the output, never swallowed
            import traceback

            self.raw.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
            self.log(f"SECTION {key} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            return None
        finally:
            self.save(plots=False)

    def check_only(self) -> None:
        """Record, as an error of the run, the names in `only` that no section had."""
        unknown = sorted((self.only or frozenset()) - set(self.names))
        if unknown:
            self.raw.setdefault("errors", {})["only"] = (f"no section named {', '.join(unknown)}; this run's "
                                                         f"sections: {', '.join(self.names)}")

    def save(self, plots: bool) -> dict | None:
        """Rewrite the report from the raw numbers. If that fails (a bug in the report, not a
        measurement), the raw numbers are written to bench_raw.json instead and the run goes on."""
        try:
            rep = build_report(self.raw)
            write_report(rep, self.out_dir, plots=plots)
            return rep
        except Exception as e:  # noqa: BLE001 - logged, and the numbers are kept
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "bench_raw.json").write_text(json.dumps(self.raw, indent=1, default=str))
            self.log(f"REPORT FAILED ({type(e).__name__}: {e}); raw numbers in {self.out_dir}/bench_raw.json")
            return None


def run_bench(*, model: str | None, out_dir: Path, log: Log = print, quick: bool = False,
              kv_memory: int = 24 << 30, geometry: Qwen2Config = QWEN25_CODER_7B,
              load_test_dir: Path | None = None, profile_steps: int = 5, features: bool = True,
              only: frozenset[str] | None = None) -> dict:
    """Run everything; write bench.json, bench.md and plots into `out_dir`; return the report.
    `features=False` turns prefix caching and speculation off (the no-regression baseline). `only`: run
    just these sections (their keys in raw / the errors, e.g. "decode_ctx128", "batch8", "lm_head_ab";
    the bandwidths always run, the engines are still built); a name no section has is an error."""
    from nanoqwen_runtime.engine.synthetic import random_weights

    from nanoqwen_bench.gpu import read_bandwidth

    from .bench_profile import profile_decode_ops

    device = torch.device("cuda")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    raw: dict = {"meta": {"command": "nanoqwen-cli bench" + (f" --model {model}" if model else ""),
                          "device": torch.cuda.get_device_name(device), "date": now,
                          "torch": torch.__version__, "python": platform.python_version(),
                          "prefix_caching": features, "speculation": "ngram:4" if features else "off"},
                 "decode_batch1": [], "decode_batched": [], "prefill": [], "eager": []}
    run = _Run(out_dir, log, raw, only)
    rb = run.section("read_bandwidth", read_bandwidth, device)
    if rb:
        log(f"read bandwidth {rb['bytes_per_s'] / 1e9:.0f} GB/s ({rb['nbytes'] / 2**30:.0f} GiB, median of "
            f"{rb['reps']}, {rb['min_s'] * 1e3:.3f}-{rb['max_s'] * 1e3:.3f} ms)")
    cb = run.section("copy_bandwidth_Bps", copy_bandwidth, device)
    if cb:
        log(f"copy bandwidth {cb / 1e9:.0f} GB/s (read + write)")
    read_bps = rb["bytes_per_s"] if rb else None

    cfg = EngineConfig(kv_memory_bytes=kv_memory, max_model_len=None if not quick else 8192,
                       prefix_caching=features, speculation=SpeculationConfig(k=4) if features else None)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if model:
        engine = Engine.from_file(model, cfg)
        raw["model_load"] = asdict(engine.load_stats) | {"upload_GBps": engine.load_stats.gbps}
        raw["meta"]["model"] = model
    else:
        weights = random_weights(geometry, device, seed=0, symmetric=False)
        torch.cuda.synchronize()
        name = next((k.upper() for k, g in QWEN25_CODER_GEOMETRIES.items() if g == geometry), "custom")
        head = "the tied bf16 embedding as lm_head" if geometry.tie_word_embeddings else "bf16 lm_head"
        raw["meta"]["model"] = (f"synthetic Qwen2.5-Coder-{name} geometry (random INT4 g128 asym weights: "
                                f"the default recipe's layout; {head})")
        engine = Engine(geometry, weights, cfg)
    raw["engine_start_s"] = time.perf_counter() - t0
    raw["num_kv_blocks"] = engine.num_blocks
    log(f"engine ready in {raw['engine_start_s']:.1f}s ({engine.num_blocks} KV blocks)")

    # "32K": the model's 32768-token limit holds the prompt and the 64 decoded tokens
    contexts = [128, 4096, 32768 - 128] if not quick else [128, 4096]
    for ctx in contexts:
        r = run.section(f"decode_ctx{ctx}", decode_at_context, engine, ctx, 64 if ctx > 4096 else 128,
                        seed=ctx, into="decode_batch1")
        if r is None:
            continue
        r["bytes_per_token_parts"] = bytes_per_token(engine, ctx)
        total = sum(r["bytes_per_token_parts"].values())
        frac = f"{100 * r['graph_tok_s'] * total / read_bps:.0f}% of the read roofline" if read_bps else ""
        log(f"batch 1 ctx {ctx}: graph {r['graph_tok_s']:.0f} tok/s, engine {r['engine_tok_s']:.0f} tok/s, "
            f"{total / 1e9:.3f} GB/token, {frac}")
    run.save(plots=False)
    for batch in DECODE_BATCHES:
        r = run.section(f"batch{batch}", decode_at_context, engine, 128, 128, batch=batch, seed=100 * batch,
                        into="decode_batched")
        if r is not None:
            log(f"batch {batch}: engine {r['engine_tok_s']:.0f} tok/s aggregate, "
                f"graph {r['graph_tok_s']:.0f}")
    for n in (512, 4096):
        r = run.section(f"prefill{n}", prefill_rate, engine, n, seed=7 + n, into="prefill")
        if r is not None:
            log(f"prefill {r['prompt']}: {r['prefill_tok_s']:.0f} tok/s")
    if run.section("ttft_2k", prefill_rate, engine, 2048, seed=11):
        log(f"TTFT 2K prompt: {1e3 * raw['ttft_2k']['ttft_s']:.1f} ms")
    raw["engine_stats"] = asdict(engine.stats())
    if features:
        pc = run.section("prefix_cache", prefix_cache_ttft, engine)
        if pc:
            log(f"prefix cache: TTFT with a cached {pc['prefix_tokens']}-token prefix "
                f"{1e3 * pc['warm_ttft_s']:.1f} ms vs cold {1e3 * pc['cold_ttft_s']:.1f} ms "
                f"({100 * pc['warm_over_cold']:.1f}%, goal <= 15%)")
    raw["kv_blocks_used_after"] = engine.kv_blocks_used()
    m = run.section("memory", memory, engine)
    if m:
        gb = {k: v / 1e9 for k, v in m.items() if k.endswith("_bytes")}
        log(f"memory: container {gb['container_bytes']:.2f} GB, weights on GPU "
            f"{gb['weights_gpu_bytes']:.2f} GB (dense cache {gb['dense_cache_bytes']:.2f}), KV pool "
            f"{gb['kv_pool_bytes']:.2f} GB, graphs "
            f"{gb['graph_device_bytes']:.2f} GB, peak allocated {gb['peak_allocated_bytes']:.2f} GB")
        log(f"KV pool: {m['kv_pool_tokens']} tokens; a bf16 dense weight cache would take "
            f"{m['kv_tokens_of_dense_cache']} of them")
    weights_ref, geom = engine.weights, engine.geom
    del engine
    torch.cuda.empty_cache()

    # eager: batch <= 8 runs the INT4 GEMVs either way, so no bf16 dense cache (saves 13 GB at 7B);
    # synchronous steps, which the per-op profile needs (overlap off)
    eager = Engine(geom, weights_ref, EngineConfig(kv_memory_bytes=4 << 30, max_model_len=4096, mode="eager",
                                                   dense_weight_cache=False, overlap=False))
    for b in (1, 8):
        r = run.section(f"eager{b}", decode_at_context, eager, 128, 32, batch=b, seed=200, into="eager")
        if r is not None:
            log(f"eager batch {r['batch']}: {r['engine_tok_s']:.1f} tok/s")
    p = run.section("profile", profile_decode_ops, eager, steps=profile_steps)
    if p:
        log(f"decode step, eager, CUDA events: {p['launches_per_step']} launches, "
            f"{p['kernel_us_per_step']:.0f} us of GPU time ({p['starved_chunks']} of {p['chunks']} chunks "
            "where the host fell behind)")
    for b in PROFILE_BATCHES:  # the INT4 GEMM's steps, per kernel: where the batched time goes
        p = run.section(f"profile{b}", profile_decode_ops, eager, steps=profile_steps, batch=b,
                        into="profile_batched")
        if p:
            log(f"decode step at batch {b}, eager, CUDA events: {p['kernel_us_per_step']:.0f} us of GPU time")
    del eager
    torch.cuda.empty_cache()
    if features:
        fc = run.section("features_cost", features_cost, geom, weights_ref)
        for r in (fc or {}).get("rows", []):
            log(f"features on/off batch {r['batch']}: {r['a_tok_s']:.0f} / {r['b_tok_s']:.0f} tok/s = "
                f"{r['a_over_b']:.3f} (spread {100 * max(r['spread_a'], r['spread_b']):.1f}%)"
                + ("  REGRESSION" if r["a_slower"] else ""))
    if not model:
        ls = run.section("layout_speed", layout_speed, geom, weights_ref)
        for r in (ls or {}).get("rows", []):
            log(f"g128 asym/sym batch {r['batch']}: {r['a_tok_s']:.0f} / {r['b_tok_s']:.0f} tok/s = "
                f"{r['a_over_b']:.3f}")
        ov = run.section("overlap_ab", overlap_ab, geom, weights_ref)
        for r in (ov or {}).get("rows", []):
            log(f"overlap on/off batch {r['batch']}: engine {r['a_tok_s']:.0f} / {r['b_tok_s']:.0f} tok/s = "
                f"{r['a_over_b']:.3f}; graph {r['a_graph_tok_s']:.0f} / {r['b_graph_tok_s']:.0f}"
                + ("  SLOWER" if r["a_slower"] else ""))
        lh = run.section("lm_head_ab", lm_head_ab, geom, weights_ref)
        for r in (lh or {}).get("rows", []):
            frac = (f" = {100 * r['a_graph_tok_s'] * lh['bytes_per_token_a'] / read_bps:.0f}% of the "
                    "read roofline" if read_bps and r["a_graph_tok_s"] else "")
            log(f"lm_head int4 / bf16 batch {r['batch']}: engine "
                f"{r['a_tok_s']:.0f} / {r['b_tok_s']:.0f} tok/s; graph {r['a_graph_tok_s']:.0f} / "
                f"{r['b_graph_tok_s']:.0f}{frac}")
    del weights_ref
    if load_test_dir is not None and run.section("load_test", load_time, geometry, load_test_dir):
        ld = raw["load_test"]
        plain, ver = ld["plain"], ld["verify"]
        log(f"load {ld['file_bytes'] / 1e9:.2f} GB: --no-verify {plain['total_seconds']:.2f} s "
            f"({plain['upload_GBps']:.1f} GB/s upload), verified (default) {ver['total_seconds']:.2f} s "
            f"(hashing {ver['verify_seconds']:.2f} s beside the copies, waited "
            f"{ver['verify_wait_seconds']:.2f} s; NaN/Inf check {ver['finite_seconds']:.3f} s)")
    run.check_only()
    rep = run.save(plots=True)
    if rep is None:
        raise RuntimeError(f"the report could not be built; the raw numbers are in {out_dir}/bench_raw.json")
    return rep
