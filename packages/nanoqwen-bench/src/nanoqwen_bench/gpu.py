"""Benchmark-only kernels (nanoqwen_kernels' csrc/bench.cu, op family "bench"): the read-bandwidth
ceiling and a GPU-side wait, and the CUDA-graph / CUDA-event timing the benchmarks share.

    bw = read_bandwidth(torch.device("cuda"))          # bytes read per second, median of the reps
    read_xor(buf, sink)                                # one pass over buf; sink ^= XOR of its words
    spin(50_000_000)                                   # the current stream waits 50 ms on the GPU
    l2_prefetch(weights_bytes, evict_last=True)        # the L2 starts fetching a buffer; no wait
    step_phases(data, bounds, sink, bar, blocks=g, mode=PHASES_BARRIER)  # resident CTAs read phases
    step_phases_dataflow(data, bounds, sink, counters, blocks=sms, groups=32)  # ... waiting per slice
    t = time_graph(lambda i: op(bufs[i % 2]), reps=20)  # s per call, from one CUDA graph of 20 calls
    g = capture_graph(lambda i: op(bufs[i % 2]), 20)   # that graph itself, warmed and replayed 3 times
    t = median_replay_seconds(graph, replays=50)       # s per replay of an existing graph
    ts = event_seconds(lambda: op(buf), reps=10)       # s of each of 10 eager calls (after 3 untimed)

A decode step reads weights and KV and writes almost nothing, so its ceiling is the rate at which the
GPU can only read, not a device-to-device copy (half reads, half writes). `read_bandwidth` measures
that ceiling the same way the roofline is used: one large buffer (4 GiB by default, ~80x the 50 MB
L2), read once per launch with 16-byte loads, timed with CUDA events, median over `reps` launches.

Launches go through `launch.launch` on the current torch stream, like every kernel of the package.
"""

from __future__ import annotations

import statistics

import numpy as np
import torch
from nanoqwen_kernels.launch import check, launch, ptr, require_sm90

FAMILY = "bench"
READ_THREADS = 256
READ_BLOCKS_PER_SM = 8  # 8 x 256 threads = 2048, the most an SM holds
DEFAULT_READ_BYTES = 4 << 30


def read_xor(data: torch.Tensor, sink: torch.Tensor) -> None:
    """One pass over `data` (any dtype, contiguous, 16-byte aligned, nbytes a multiple of 16): sink[0]
    (int32 [1]) ^= the XOR of every 32-bit word of data. Reads data.nbytes bytes, writes 4 per warp."""
    index = require_sm90(data.device)
    if not data.is_contiguous() or data.data_ptr() % 16 or data.nbytes % 16:
        raise ValueError("data: must be contiguous, 16-byte aligned, and a multiple of 16 bytes long")
    check(sink, "sink", torch.int32, (1,), data.device, align=4)
    n_vec = data.nbytes // 16
    if n_vec == 0:
        return
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    blocks = min(sms * READ_BLOCKS_PER_SM, -(-n_vec // READ_THREADS))
    launch(FAMILY, "read_xor_u32x4", index, (blocks, 1, 1), (READ_THREADS, 1, 1),
           (ptr(data), np.uint64(n_vec), ptr(sink)))  # fmt: skip


PHASES_BACK_TO_BACK, PHASES_BARRIER, PHASES_BARRIER_PREFETCH, PHASES_BARRIER_PRELOAD = 0, 1, 2, 3  # bench.cu
STEP_PHASES_THREADS = 512
STEP_PHASES_PRELOAD_VECTORS = 4  # step_phases_preload_u32x4's PRELOAD


def step_phases_kernel(mode: int) -> str:
    """bench.cu's entry for a step_phases `mode`: preloading into registers has a kernel of its own
    (more registers, fewer CTAs per SM)."""
    return "step_phases_preload_u32x4" if mode == PHASES_BARRIER_PRELOAD else "step_phases_u32x4"


def step_phases(data: torch.Tensor, bounds: torch.Tensor, sink: torch.Tensor, bar: torch.Tensor, *,
                blocks: int, mode: int, prefetch_bytes: int = 0, phases: slice | None = None,
                check_flags: torch.Tensor | None = None, check_errors: torch.Tensor | None = None) -> None:
    """One launch of bench.cu's `step_phases_kernel(mode)`: `blocks` CTAs of 512 threads read the
    phases of `data` (contiguous, 16-byte aligned) one after another, phase p being the 16-byte vectors
    [bounds[p], bounds[p + 1]) (bounds: int64 [P + 1], ascending, on the device); sink (int32 [1]) ^=
    the XOR of every word read. `phases` (a step-1 slice of 0..P) launches only those phases. Between
    phases, by `mode`: nothing (PHASES_BACK_TO_BACK); a grid barrier (PHASES_BARRIER); the barrier after
    asking the L2 for the first `prefetch_bytes` of each CTA's share of the next phase
    (PHASES_BARRIER_PREFETCH); or the barrier after each thread loads its first
    STEP_PHASES_PRELOAD_VECTORS vectors of the next phase into registers (PHASES_BARRIER_PRELOAD).
    bar: int32 [2], zero before the first launch. check_flags / check_errors (int32 [blocks] zeroed,
    int32 [1]): check_errors counts the CTAs a barrier let through early (a test of the barrier; costs
    `blocks` loads per CTA per barrier).

    Every CTA must be resident at once (the barrier waits for all): `blocks` <= resident_blocks() of
    step_phases_kernel(mode), times the SMs."""
    index = require_sm90(data.device)
    if not data.is_contiguous() or data.data_ptr() % 16:
        raise ValueError("data: must be contiguous and 16-byte aligned")
    n_phases = bounds.numel() - 1
    start, stop, step = (phases or slice(None)).indices(n_phases)
    if step != 1 or stop <= start:
        raise ValueError(f"phases {phases}: a non-empty step-1 slice of 0..{n_phases} is needed")
    check(bounds, "bounds", torch.int64, (n_phases + 1,), data.device, align=8)
    check(sink, "sink", torch.int32, (1,), data.device, align=4)
    check(bar, "bar", torch.int32, (2,), data.device, align=4)
    if mode not in (PHASES_BACK_TO_BACK, PHASES_BARRIER, PHASES_BARRIER_PREFETCH, PHASES_BARRIER_PRELOAD):
        raise ValueError(f"mode {mode}: 0, 1, 2 or 3")
    if blocks <= 0 or prefetch_bytes < 0 or prefetch_bytes % 16:
        raise ValueError("blocks > 0, and prefetch_bytes a non-negative multiple of 16, are needed")
    if (check_flags is None) != (check_errors is None):
        raise ValueError("check_flags and check_errors go together")
    if check_flags is not None:
        check(check_flags, "check_flags", torch.int32, (blocks,), data.device, align=4)
        check(check_errors, "check_errors", torch.int32, (1,), data.device, align=4)
    args = (ptr(data), np.uint64(bounds.data_ptr() + 8 * start), np.int32(stop - start), np.int32(mode),
            np.uint64(prefetch_bytes // 16), ptr(sink), ptr(bar), ptr(check_flags), ptr(check_errors))
    launch(FAMILY, step_phases_kernel(mode), index, (blocks, 1, 1), (STEP_PHASES_THREADS, 1, 1), args)


DATAFLOW_THREADS = 512  # bench.cu DF_THREADS: a producer warp and 15 consumer warps
DATAFLOW_MAX_SLOTS = 12  # DF_MAX_SLOTS
DATAFLOW_SLOT_BYTES = 16 << 10  # DF_SLOT_VEC x 16


def step_phases_dataflow(data: torch.Tensor, bounds: torch.Tensor, sink: torch.Tensor, counters: torch.Tensor,
                         *, blocks: int, groups: int, slots: int = DATAFLOW_MAX_SLOTS,
                         progress: torch.Tensor | None = None,
                         check_errors: torch.Tensor | None = None) -> None:
    """One launch of bench.cu's `step_phases_dataflow_u32x4`: `blocks` CTAs read the phases of `data`
    (as `step_phases`) through a ring of `slots` 16 KB shared-memory slots filled by bulk copies that
    run ahead across phase ends; each CTA's part g of phase p > 0 waits until the `groups` groups'
    group g has finished phase p - 1 (bench.cu says how). sink (int32 [1]) ^= the XOR of every word
    read. counters: int32 [P * groups], zero before the launch (each ends at its group's size).
    progress / check_errors (int32 [blocks] zeroed, int32 [1]): check_errors counts the CTAs a wait let
    through before their group had finished. Every CTA must be resident at once (one per SM holds the
    12-slot ring): `groups` <= `blocks` <= the SMs x CTAs per SM."""
    index = require_sm90(data.device)
    if not data.is_contiguous() or data.data_ptr() % 16:
        raise ValueError("data: must be contiguous and 16-byte aligned")
    n_phases = bounds.numel() - 1
    if n_phases < 1:
        raise ValueError("bounds: at least one phase is needed")
    check(bounds, "bounds", torch.int64, (n_phases + 1,), data.device, align=8)
    check(sink, "sink", torch.int32, (1,), data.device, align=4)
    if not 1 <= groups <= blocks:
        raise ValueError(f"groups {groups}: 1 to blocks ({blocks}) groups of CTAs are needed")
    if not 1 <= slots <= DATAFLOW_MAX_SLOTS:
        raise ValueError(f"slots {slots}: 1 to {DATAFLOW_MAX_SLOTS}")
    check(counters, "counters", torch.int32, (n_phases * groups,), data.device, align=4)
    if (progress is None) != (check_errors is None):
        raise ValueError("progress and check_errors go together")
    if progress is not None:
        check(progress, "progress", torch.int32, (blocks,), data.device, align=4)
        check(check_errors, "check_errors", torch.int32, (1,), data.device, align=4)
    args = (ptr(data), ptr(bounds), np.int32(n_phases), np.uint32(groups), np.int32(slots), ptr(counters),
            ptr(sink), ptr(progress), ptr(check_errors))
    launch(FAMILY, "step_phases_dataflow_u32x4", index, (blocks, 1, 1), (DATAFLOW_THREADS, 1, 1), args,
           shared_mem=slots * DATAFLOW_SLOT_BYTES)


def resident_blocks(kernel: str, threads: int, device: torch.device) -> int:
    """How many CTAs of bench.cu's `kernel` at `threads` threads (no dynamic shared memory) one SM holds
    at once: the driver's occupancy answer."""
    import ctypes

    from nanoqwen_kernels.cuda_driver import _error_text, _libcuda
    from nanoqwen_kernels.launch import get_function

    fn = get_function(FAMILY, kernel, require_sm90(device))
    lib, n = _libcuda(), ctypes.c_int(0)
    rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(fn.kernel.ptr),
                                                         ctypes.c_int(threads), ctypes.c_size_t(0))
    if rc != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor({kernel}): {_error_text(lib, rc)}")
    return n.value


def spin(ns: int, device: torch.device | None = None) -> None:
    """Hold the current stream of `device` for `ns` nanoseconds (one thread reading %globaltimer)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    index = require_sm90(device)
    if ns < 0:
        raise ValueError(f"ns must be >= 0, got {ns}")
    launch(FAMILY, "spin_ns", index, (1, 1, 1), (1, 1, 1), (np.uint64(ns),))


def l2_prefetch(data: torch.Tensor, *, chunk: int = 32 << 10, evict_last: bool = False,
                blocks: int = 8) -> None:
    """Ask the L2 to fetch data's bytes (contiguous, 16-byte aligned, nbytes a multiple of 16) and return
    without waiting: `blocks` x 128 threads each issue cp.async.bulk.prefetch.L2 requests of `chunk`
    bytes (a multiple of 16), with an L2 evict_last policy if asked. Changes no memory."""
    index = require_sm90(data.device)
    if not data.is_contiguous() or data.data_ptr() % 16 or data.nbytes % 16 or chunk % 16 or chunk <= 0:
        raise ValueError("data: contiguous, 16-byte aligned, nbytes a multiple of 16; chunk a positive "
                         "multiple of 16")
    launch(FAMILY, "l2_prefetch", index, (blocks, 1, 1), (128, 1, 1),
           (ptr(data), np.uint64(data.nbytes), np.uint32(chunk), np.int32(1 if evict_last else 0)))


def read_bandwidth(device: torch.device, nbytes: int = DEFAULT_READ_BYTES, reps: int = 30) -> dict:
    """Read-only bandwidth of `device`: {"bytes_per_s", "nbytes", "reps", "median_s", "min_s", "max_s"}.

    One buffer of `nbytes` random bytes (never zeros), read by `read_xor` `reps` times after 3
    warm-up passes, each launch timed with CUDA events; the rate is nbytes over the median time. The
    XOR the kernel computes is checked against torch's before any timing, so a kernel that skipped
    data could not report a rate."""
    require_sm90(device)
    nbytes -= nbytes % 16
    data = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=device)
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    read_xor(data[: 1 << 20], sink)  # 4 MB: checked against a reduction done another way
    want = _xor_reduce(data[: 1 << 20])
    if int(sink.item()) != want:
        raise RuntimeError(f"read_xor_u32x4 computed {int(sink.item()):#x}, torch {want:#x}: the kernel "
                           "does not read what it should; no bandwidth is reported")
    for _ in range(3):
        read_xor(data, sink)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        read_xor(data, sink)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del data
    med = statistics.median(times)
    return {"bytes_per_s": nbytes / med, "nbytes": nbytes, "reps": reps, "median_s": med,
            "min_s": min(times), "max_s": max(times)}


def _xor_reduce(words: torch.Tensor) -> int:
    """XOR of int32 words as a signed int32 value (numpy on the host; the check is small)."""
    return int(np.bitwise_xor.reduce(words.cpu().numpy().view(np.uint32)).view(np.int32))


def event_seconds(fn, reps: int, warm: int = 3) -> list[float]:
    """GPU seconds of each of `reps` eager calls of fn(), after `warm` untimed ones: CUDA events on the
    current stream around each call, waited for before the next."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def median_replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median GPU time (s) of one `graph.replay()` over `replays` replays, each timed with CUDA events
    on the current stream."""
    return statistics.median(event_seconds(graph.replay, replays, warm=0))


def capture_graph(fn, n: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of fn(0) .. fn(n - 1): warmed once eagerly on a side stream (module loads, cuBLAS
    handles), captured on that stream, then replayed 3 times and synchronized, so that the first timed
    replay finds everything loaded. `fn(i)` enqueues its work on the current torch stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(n):
            fn(i)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(n):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(fn, reps: int, replays: int = 15) -> float:
    """Median seconds per call of fn(i) for i in range(reps), captured in one CUDA graph (launch gaps
    as in the engine's replayed decode step) by `capture_graph`, then `median_replay_seconds` / reps."""
    return median_replay_seconds(capture_graph(fn, reps), replays) / reps
