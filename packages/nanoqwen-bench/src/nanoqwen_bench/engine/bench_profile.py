"""Time each op and each kernel launch of eager decode steps with CUDA events (no torch.profiler).

    prof = profile_decode_ops(eager_engine, steps=5)   # {"ops": [...], "kernels": [...], ...}

How: `nanoqwen_kernels`' `launch()` is wrapped to record a CUDA event (a "mark") on the current
stream before every kernel launch, and the engine's op backend (`engine.runner.ops`) is wrapped in
`TimedOps`, which knows which op is running and records a mark before the ops that launch no
nanoqwen kernel (cuBLAS GEMMs such as the bf16 lm_head; which ops those are is learnt in a first,
untimed calibration step that marks every op). Each mark names the (op, kernel) segment of GPU work
that follows it, up to the next mark; a closing mark follows the step's last op (`sample`):

    mark(qkv, gemv)  [gemv]  mark(rope, rope_kernel)  [rope]  ...  mark(linear lm_head)  [cuBLAS] ...

Timing eager work with events has one trap: the host launches slower (~20 us per launch) than the
GPU runs small kernels (2-7 us), so the GPU would idle between kernels and every event interval would
measure the host. So the GPU is held back: before the step and then every `SPIN_EVERY` marks, a
one-thread kernel (`nanoqwen_bench.gpu.spin`) waits on the GPU for longer than the host needs to
queue the next chunk of marks and launches; the chunk then runs back to back from the queue, at the
GPU's pace. The wait itself is a segment of its own ("<spin>") and is left out of every sum. The
host time to queue each chunk is checked against the wait: a chunk the host did not queue in time
(or that the driver's queue could not hold: the host would then block) is counted in
`starved_chunks`, and the report says so.

Each step synchronises once, at its end (the engine reads the sampled tokens back), and only then
are the events read. Launches are counted per step (`launches_per_step`): nanoqwen kernel launches
plus one for each op call that launched none (a cuBLAS GEMM, e.g. the bf16 lm_head).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import torch
from nanoqwen_runtime.engine.residual import NormedInput
from nanoqwen_runtime.engine.scheduler import Request
from nanoqwen_runtime.events import TokenEvent
from nanoqwen_runtime.sampling import SamplingParams

SPIN_EVERY = 64  # marks per chunk queued behind one GPU-side wait
SPIN_FACTOR = 4.0  # the wait is this many times the host's measured time to queue a chunk
SPIN_MIN_NS = 2_000_000
SPIN = "<spin>"
END = "<end>"
LIBRARY = "<torch/cuBLAS>"
# the op calls of ModelRunner._forward; anything else on the backend (plans, setup) passes through
TIMED_OPS = ("embed", "rms_norm", "add_rms_norm", "norm", "linear", "linear_residual", "qkv_projection",
             "mlp_down", "silu_mul", "qkv_rope_kv_write", "attention_run", "attention", "logits_range",
             "sample")


class Timeline:
    """Marks on the current CUDA stream, each labelled (op, kernel) for the GPU work that follows it.

    event_factory / spin_fn / clock are injectable so that the bookkeeping can be tested on the CPU.
    """

    def __init__(self, event_factory: Callable | None = None, spin_fn: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        if spin_fn is None:
            from nanoqwen_bench.gpu import spin as spin_fn
        self._spin_fn = spin_fn
        self._clock = clock
        self.marks: list[tuple[object, str, str | None]] = []
        self.spin_ns = 0  # 0: no waits (the calibration step)
        self.chunk_host_s: list[float] = []  # host time to queue each chunk after its wait
        self.suspended = False
        self.op: str | None = None
        # ops whose calls get a mark of their own: all (None) in the calibration step, then only those
        # that launched no nanoqwen kernel there (their cuBLAS/torch work needs a mark before it; a
        # launching op's time starts at its first launch's mark)
        self.library_ops: set[str] | None = None
        self.closed = False
        self._since_spin = 0
        self._chunk_t0: float | None = None

    def begin_step(self) -> None:
        self.marks, self.chunk_host_s, self._since_spin, self._chunk_t0 = [], [], SPIN_EVERY, None
        self.closed = False

    def mark(self, op: str, kernel: str | None) -> None:
        if self.spin_ns and self._since_spin >= SPIN_EVERY:
            self._spin()
        ev = self._event()
        ev.record()
        self.marks.append((ev, op, kernel))
        self._since_spin += 1

    def _spin(self) -> None:
        now = self._clock()
        if self._chunk_t0 is not None:
            self.chunk_host_s.append(now - self._chunk_t0)
        ev = self._event()
        ev.record()
        self.marks.append((ev, SPIN, SPIN))
        self.suspended = True  # the wait is launched through the wrapped launch(): not a kernel of the step
        try:
            self._spin_fn(self.spin_ns)
        finally:
            self.suspended = False
        self._chunk_t0, self._since_spin = now, 0

    def warm_up(self) -> None:
        """One zero-length wait before anything is timed: the first call loads (in a fresh process,
        compiles) the wait kernel, and inside a timed chunk that second of host time starved the chunk
        (as when the profile is the process's first use of the kernel)."""
        self.suspended = True
        try:
            self._spin_fn(0)
        finally:
            self.suspended = False

    def close(self) -> None:
        """The closing mark, right after the step's last op (before the step reads its tokens back:
        after that synchronisation the host time would include waiting for the GPU)."""
        if self.closed:
            return
        self.mark(END, None)
        if self._chunk_t0 is not None:
            self.chunk_host_s.append(self._clock() - self._chunk_t0)
        self.closed = True

    def segments(self) -> list[tuple[str, str | None, float]]:
        """(op, kernel, seconds) between consecutive marks; call after the step synchronised."""
        out = []
        for (a, op, kernel), (b, _, _) in zip(self.marks, self.marks[1:], strict=False):
            out.append((op, kernel, a.elapsed_time(b) / 1e3))
        return out


class TimedOps:
    """The engine's op backend with a mark before every op call (`TIMED_OPS`); `label` names the call
    (e.g. "linear qkv"), `nbytes` counts the bytes it must move."""

    def __init__(self, inner, timeline: Timeline, label: Callable, nbytes: Callable):
        self._inner, self._tl, self._label, self._nbytes = inner, timeline, label, nbytes
        self.calls: list[tuple[str, int]] = []  # (label, bytes) of the current step, in order

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in TIMED_OPS or not callable(attr):
            return attr

        def timed(*args, **kw):
            label = self._label(name, args, kw)
            self.calls.append((label, self._nbytes(name, args, kw)))
            tl = self._tl
            tl.op = label
            if tl.library_ops is None or label in tl.library_ops:
                tl.mark(label, None)
            try:
                return attr(*args, **kw)
            finally:
                tl.op = None
                if name == "sample":  # the last op of ModelRunner._forward
                    tl.close()

        return timed


def patch_launches(timeline: Timeline) -> Callable[[], None]:
    """Wrap `nanoqwen_kernels.launch.launch` (and every nanoqwen_kernels module's imported name for
    it) so each launch is marked with its kernel name; returns the function that undoes it."""
    from nanoqwen_kernels import launch as klaunch

    original = klaunch.launch

    def marked(family, kernel, *args, **kw):
        if not timeline.suspended:
            timeline.mark(timeline.op or "<outside ops>", kernel)
        return original(family, kernel, *args, **kw)

    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("nanoqwen_kernels") and getattr(m, "launch", None) is original]
    if klaunch not in patched:
        raise RuntimeError("nanoqwen_kernels.launch.launch is not the function its modules import")
    for m in patched:
        m.launch = marked

    def undo() -> None:
        for m in patched:
            m.launch = original

    return undo


def _linear_names(weights) -> dict[int, str]:
    names = {id(weights.lm_head): "lm_head"}
    for lw in weights.layers:
        for n in ("qkv", "o_proj", "gate_up", "down"):
            names[id(getattr(lw, n))] = n
    return names


def _fused(engine, predicate: str, lin, rows: int) -> bool:
    """The op backend's own answer to `predicate` (`fuses_silu_down` / `fuses_qkv_rope`: does this op
    of `rows` rows run fused?); False on a backend that never fuses (the torch reference)."""
    fuses = getattr(engine.ops, predicate, None)
    return fuses is not None and fuses(lin, rows)


def _fuses_norm(engine, x, lin) -> bool:
    """Whether the op backend makes the NormedInput x as the prologue of `lin`'s GEMV (False on a
    backend that never fuses, or for a plain tensor input)."""
    fuses = getattr(engine.ops, "fuses_norm", None)
    return isinstance(x, NormedInput) and fuses is not None and fuses(x, lin)


def op_accounting(engine, context: int):
    """(label, nbytes) functions for `TimedOps`: bytes each op call must move at decode, counting each
    input read once and each output written once; attention reads `context` tokens of K and V per row.
    A linear's NormedInput input counts the norm's bytes in the linear (its launch runs inside the
    linear's op when not fused), a pending residual add's in the norm that makes it."""
    g = engine.geom
    names = _linear_names(engine.weights)
    kv_token_layer = g.kv_bytes_per_token() // g.num_hidden_layers

    def b(t):
        return t.numel() * t.element_size()

    def rows(x):
        return x.rows if isinstance(x, NormedInput) else x.shape[0]

    def norm_form(x, lin) -> str:
        if not isinstance(x, NormedInput):
            return ""
        if _fuses_norm(engine, x, lin):
            return " (RMSNorm fused)"
        return " (after add + RMSNorm)" if x.update.pending is not None else " (after RMSNorm)"

    def input_bytes(x, lin) -> int:
        """x read by the linear; for a NormedInput, the norm too: fused, the residual and the norm
        weight; else the norm kernel's traffic (a pending add: x and residual read, residual and out
        written; else residual read, out written) and out read again by the linear."""
        if not isinstance(x, NormedInput):
            return b(x)
        if _fuses_norm(engine, x, lin):
            return b(x.residual) + b(x.weight)
        return (4 if x.update.pending is not None else 2) * b(x.residual) + b(x.weight) + b(x.out)

    def residual_bytes(lin, out, residual) -> int:
        """The output of a linear feeding the residual: fused, the residual read and written; else out
        written (the add is the next norm's)."""
        return 2 * b(residual) if _fused(engine, "fuses_residual", lin, out.shape[0]) else b(out)

    def label(op, args, kw):
        if op == "linear":
            return f"linear {names.get(id(args[1]), '?')}{norm_form(args[0], args[1])}"
        if op == "linear_residual":  # merge: the attention's split rows merged in its staging
            merged = " (attention merge in)" if kw.get("merge") is not None else ""
            return f"linear {names.get(id(args[1]), '?')}{merged} + residual"
        if op == "mlp_down":
            form = " fused" if _fused(engine, "fuses_silu_down", args[2], args[0].shape[0]) else ", then down"
            return f"mlp_down {names.get(id(args[2]), '?')} (silu*mul{form}) + residual"
        if op == "qkv_projection":  # the qkv linear and RoPE / K/V write: one fused launch or two
            return f"linear {names.get(id(args[1]), '?')} + rope/KV write{norm_form(args[0], args[1])}"
        if op == "norm":  # the final norm
            return "add_rms_norm" if args[0].update.pending is not None else "rms_norm"
        return op

    def nbytes(op, args, kw):
        if op == "embed":
            return 2 * b(args[2])
        if op == "rms_norm":
            return 2 * b(args[0]) + b(args[1])
        if op == "add_rms_norm":  # x, residual read; residual, out written; weight
            return 4 * b(args[0]) + b(args[2])
        if op == "norm":
            x = args[0]
            return (4 if x.update.pending is not None else 2) * b(x.residual) + b(x.weight)
        if op == "linear":
            bias = kw.get("bias", args[3] if len(args) > 3 else None)
            bias_bytes = b(bias) if bias is not None else 0
            return input_bytes(args[0], args[1]) + args[1].nbytes + b(args[2]) + bias_bytes
        if op == "linear_residual":  # args: x, lin, out, residual
            return b(args[0]) + args[1].nbytes + residual_bytes(args[1], args[2], args[3])
        if op == "mlp_down":  # the unfused form writes and reads the [M, I] activation once more
            act = 0 if _fused(engine, "fuses_silu_down", args[2], args[0].shape[0]) else 2 * b(args[1])
            return b(args[0]) + act + args[2].nbytes + residual_bytes(args[2], args[3], args[4])
        if op == "silu_mul":
            return b(args[0]) + b(args[1])
        if op == "qkv_projection":  # x, the weight (+ bias) read; q and one token's K/V per row written;
            # the unfused form also writes and reads qkv (args: x, w, bias, qkv, .., q_out at 8)
            x, qkv, q_out = args[0], args[3], args[8]
            fused = _fused(engine, "fuses_qkv_rope", args[1], rows(x))
            return (input_bytes(x, args[1]) + args[1].nbytes + (b(args[2]) if args[2] is not None else 0)
                    + b(q_out) + rows(x) * kv_token_layer + (0 if fused else 2 * b(qkv)))
        if op == "qkv_rope_kv_write":  # qkv read; q written; one token's K and V written per row
            qkv = args[0]
            return b(qkv) + b(args[5]) + qkv.shape[0] * kv_token_layer
        if op in ("attention_run", "attention"):
            q = args[1] if op == "attention_run" else args[0]
            return 2 * b(q) + q.shape[0] * context * kv_token_layer
        if op in ("sample", "logits_range"):
            return b(args[0])
        return 0

    return label, nbytes


def _step_totals(segments) -> dict:
    """One step's seconds per op and per kernel, kernel launch counts, the ops that launched a nanoqwen
    kernel, and the total (the waits and the closing mark left out)."""
    per_op: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    launches: Counter = Counter()
    launching: set[str] = set()
    for op, kernel, sec in segments:
        if op in (SPIN, END):
            continue
        per_op[op] += sec
        if kernel is None:  # the op's own GPU work before its first launch: cuBLAS / torch
            per_kernel[LIBRARY] += sec
        else:
            per_kernel[kernel] += sec
            launches[kernel] += 1
            launching.add(op)
    return {"op_s": per_op, "kernel_s": per_kernel, "launches": launches, "launching_ops": launching,
            "total_s": sum(per_op.values())}


def profile_decode_ops(engine, steps: int = 5, prompt: int = 128, timeline: Timeline | None = None,
                       batch: int = 1) -> dict:
    """Per-op and per-kernel GPU time of `steps` eager decode steps of `batch` requests (random prompts
    of `prompt` tokens, so the context is ~`prompt`): at batch 1 the GEMV path, above 8 rows the INT4
    GEMM's (the `kernels` list names which kernels ran).

    `engine` must run eagerly and synchronously (EngineConfig(mode="eager", overlap=False)), idle, with
    `max_batch >= batch`; it is left as it was found (the requests run to their end). Synchronously:
    an overlapped engine's `step()` returns with the step it queued still running, so the closing mark
    of the step is not complete when the step is read (and a step stays in flight after the profile);
    the GPU time of each op is the same either way."""
    if engine.config.mode != "eager":
        raise ValueError("profile_decode_ops times eager steps: build the engine with mode='eager'")
    if engine.config.overlap:
        raise ValueError("profile_decode_ops times synchronous steps: build the engine with overlap=False")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 1 <= batch <= engine.config.max_batch:
        raise ValueError(f"batch must be in 1..{engine.config.max_batch} (the engine's max_batch), "
                         f"got {batch}")
    tl = timeline or Timeline()
    g = engine.geom
    if engine.has_work:
        raise RuntimeError("profile_decode_ops needs an idle engine")
    gen = torch.Generator().manual_seed(3)
    # the first rows decode while later ones are still prefilled (a decode step between two prefill
    # chunks): enough tokens that none ends before the timed steps do; the rest are aborted at the end
    max_tokens = steps + 4 + batch
    for i in range(batch):
        ids = torch.randint(0, min(g.vocab_size, 150000), (prompt,), generator=gen)
        refused = engine.submit(Request(ids.tolist(), SamplingParams(max_tokens=max_tokens), f"profile{i}",
                                        ignore_eos=True))
        if refused is not None:
            raise RuntimeError(f"profile request refused: {refused.detail}")
    while True:  # the prefills (one chunk or several), then a first decode step of every row (warm)
        decodes = engine.num_steps["decode"]
        rows = _rows_stepped(engine.step())
        if engine.num_steps["decode"] != decodes and rows == batch:
            break
        if not engine.has_work:
            raise RuntimeError("the profile's requests ended before a decode step ran all of them")
    context = prompt + 1 + steps // 2  # the middle of the timed steps
    label, nbytes = op_accounting(engine, context)
    runner = engine.runner
    inner = runner.ops
    timed = TimedOps(inner, tl, label, nbytes)
    undo = patch_launches(tl) if engine.config.backend == "kernels" else (lambda: None)
    results = []
    tl.spin_ns, tl.library_ops = 0, None  # step 0 calibrates: no waits, every op marked
    tl.warm_up()
    try:
        runner.ops = timed
        for i in range(steps + 1):
            timed.calls = []
            tl.begin_step()
            decodes = engine.num_steps["decode"]
            t0 = time.perf_counter()
            rows = _rows_stepped(engine.step())
            host_s = time.perf_counter() - t0
            if engine.num_steps["decode"] != decodes + 1 or rows != batch:
                raise RuntimeError(f"a profiled step was not a decode step of {batch} rows ({rows})")
            if not tl.closed:
                raise RuntimeError("the decode step did not end with a `sample` op: cannot place the "
                                   "closing mark before its synchronisation")
            if i == 0:
                per_chunk = host_s * SPIN_EVERY / max(1, len(tl.marks))
                tl.spin_ns = max(SPIN_MIN_NS, int(SPIN_FACTOR * per_chunk * 1e9))
                launching = _step_totals(tl.segments())["launching_ops"]
                tl.library_ops = {lab for lab, _ in timed.calls} - launching
                continue
            results.append((_step_totals(tl.segments()), list(timed.calls), list(tl.chunk_host_s)))
    finally:
        runner.ops = inner
        undo()
    for i in range(batch):
        engine.abort(f"profile{i}")  # None for one that has ended
    return {"batch": batch, **summarise(results, tl.spin_ns, context)}


def _rows_stepped(events) -> int:
    """Requests that got a token in one step's events."""
    return len({ev.request for ev in events if isinstance(ev, TokenEvent)})


def summarise(results, spin_ns: int, context: int) -> dict:
    """Median over steps of each op's and kernel's time; launch counts; the starvation check.

    results: per step (`_step_totals` of its segments, its (label, bytes) op calls, its chunks' host
    seconds)."""
    steps = len(results)
    first, calls0 = results[0][0], results[0][1]
    op_bytes: dict[str, int] = defaultdict(int)
    op_calls: Counter = Counter()
    for lab, nb in calls0:
        op_bytes[lab] += nb
        op_calls[lab] += 1
    ops_seen = list(op_calls)
    kernels_seen = list(dict.fromkeys(k for r in results for k in r[0]["kernel_s"]))
    op_us = {o: statistics.median(r[0]["op_s"].get(o, 0.0) for r in results) * 1e6 for o in ops_seen}
    k_us = {k: statistics.median(r[0]["kernel_s"].get(k, 0.0) for r in results) * 1e6 for k in kernels_seen}
    kernel_launches = sum(first["launches"].values())
    # an op call that launched no nanoqwen kernel ran cuBLAS / torch work: count it as one launch
    library_calls = sum(n for lab, n in op_calls.items() if lab not in first["launching_ops"])
    chunk_s = [c for r in results for c in r[2]]
    starved = sum(1 for c in chunk_s if c * 1e9 >= spin_ns)
    kernels = []
    for k in kernels_seen:
        n = library_calls if k == LIBRARY else first["launches"].get(k, 0)
        kernels.append({"kernel": k, "launches_per_step": n, "us_per_step": k_us[k]})
    return {
        "steps": steps, "context": context, "spin_ns": spin_ns, "spin_every_marks": SPIN_EVERY,
        "chunks": len(chunk_s), "starved_chunks": starved, "chunk_host_s_max": max(chunk_s, default=0.0),
        "kernel_launches_per_step": kernel_launches, "library_calls_per_step": library_calls,
        "launches_per_step": kernel_launches + library_calls,
        "kernel_us_per_step": statistics.median(r[0]["total_s"] for r in results) * 1e6,
        "ops": sorted(({"op": o, "calls_per_step": op_calls[o], "us_per_step": op_us[o],
                        "bytes_per_step": op_bytes[o]} for o in ops_seen), key=lambda d: -d["us_per_step"]),
        "kernels": sorted(kernels, key=lambda d: -d["us_per_step"]),
    }
