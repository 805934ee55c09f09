"""GPU microbenchmarks of the decode ceilings, on the kernels of ceilings.cu (decode_ceilings's docstring
says what each measures). Called by nanoqwen_bench.kernels.decode_ceilings; every function returns
plain dicts for its JSON.

- `CeilingKernels`: ceilings.cu compiled by NVRTC for sm_90a (the package's csrc/ on the include path,
  so the GEMV loop shares csrc/gemv_int4.cuh's helpers), cached as a cubin keyed by the source hash,
  launched on the current torch stream through CuPy (graph-capturable, like nanoqwen_kernels.launch).
- `launch_cost`: graphs of N = 1, 32, 256 kernels (empty, 8 arguments, a real dependency), replay time
  / N and the marginal cost (256 vs 32); a %globaltimer timeline of 64 kernels gives the gap from one
  kernel's end to the next one's start directly.
- `streaming`: the read ceiling of 1D bulk copies into an mbarrier ring vs plain 16-byte loads, at 32 to
  192 KB in flight per SM, on 4 GiB and at the decode GEMVs' sizes (cold L2: rotating windows of a 1 GiB
  pool), every kernel's checksum compared with torch's sum first.
- `compute_ceiling`: the GEMV fragment math on shared-memory-resident weights, in weight bytes per
  second, checked against an fp64 reference and the real gemv_int4 first; and the same for the v2
  loops (ceilings/gemv_loop_v2.cuh: fewer instructions, same arithmetic), whose outputs must equal v1's
  bit for bit before their rate is reported.
"""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path

import numpy as np
import torch
from nanoqwen_kernels import build
from nanoqwen_kernels import gemv as kgemv
from nanoqwen_kernels import launch as klaunch

from nanoqwen_bench.gpu import (
    READ_BLOCKS_PER_SM,
    capture_graph,
    event_seconds,
    median_replay_seconds,
    read_xor,
)

CU_FILE = Path(__file__).parent / "ceilings.cu"
CU_HEADERS = (Path(__file__).parent / "gemv_loop_v2.cuh",)  # included by ceilings.cu (its own -I)
NVRTC_OPTIONS = ("-arch=sm_90a", "--std=c++17")
L2_ROTATE_BYTES = 240 << 20  # >= 4x the H200's 60 MB L2: a window is not re-read before this many bytes
POOL_BYTES = 1 << 30
BIG_BYTES = 4 << 30
VEC_THREADS = 512
VEC_UNROLLS = (2, 4, 6, 8, 12, 16, 24)  # the stream_vec_u{U} entry points; U > 12 only at 1 CTA/SM
RING_CONSUMER_WARPS = 4
RING_MAX_STAGES = 32  # ceilings.cu RING_MAX_STAGES
IN_FLIGHT_KB = (32, 64, 96, 128, 192)
# the decode GEMVs' packed-weight bytes (K x N / 2) at the Qwen2.5-Coder-7B geometry, and 16 MB
GEMV_SIZES = {"o": 3584 * 3584 // 2, "qkv": 4608 * 3584 // 2, "16MiB": 16 << 20, "down": 3584 * 18944 // 2,
              "gate_up": 37888 * 3584 // 2, "lm_head_int4": 152064 * 3584 // 2}  # fmt: skip


class CeilingKernels:
    """ceilings.cu on one device: `launch(name, grid, block, args, smem)` on the current torch stream."""

    def __init__(self, device: torch.device, cache: Path | None = None):
        import cupy

        self.index = klaunch.require_sm90(device)
        src = CU_FILE.read_text()
        opts = (*NVRTC_OPTIONS, f"-I{build.CSRC_DIR}", f"-I{CU_FILE.parent}")
        h = hashlib.sha256(src.encode() + "\0".join(opts).encode())
        for p in (*sorted(build.CSRC_DIR.glob("*.cuh")), *CU_HEADERS):
            h.update(p.read_bytes())
        path = (cache or build.cache_dir()) / f"ceilings-{h.hexdigest()[:20]}.cubin"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self._compile(src, opts))
        with cupy.cuda.Device(self.index):
            self.module = cupy.RawModule(path=str(path))
        self.cubin = path
        self._fns: dict[str, object] = {}

    @staticmethod
    def _compile(src: str, opts: tuple[str, ...]) -> bytes:
        from cupy_backends.cuda.libs import nvrtc

        prog = nvrtc.createProgram(src, "nq_ceilings_unit.cu", (), ())
        try:
            try:
                nvrtc.compileProgram(prog, list(opts))
            except nvrtc.NVRTCError as exc:
                raise build.KernelBuildError(
                    f"NVRTC failed on ceilings.cu: {exc}\n{nvrtc.getProgramLog(prog)}"
                ) from exc
            return nvrtc.getCUBIN(prog)
        finally:
            nvrtc.destroyProgram(prog)

    def fn(self, name: str):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self.module.get_function(name)
        return f

    def launch(self, name: str, grid, block, args, smem: int = 0) -> None:
        import cupy

        f = self.fn(name)
        if smem > 48 * 1024 and f.max_dynamic_shared_size_bytes < smem:
            f.max_dynamic_shared_size_bytes = smem
        with cupy.cuda.Device(self.index), klaunch.current_stream(self.index):
            f(tuple(grid), tuple(block), tuple(args), shared_mem=smem)

    def occupancy(self, name: str, block: int, smem: int) -> int:
        """Resident blocks per SM of `name` at this block size and dynamic shared memory (driver's answer)."""
        import ctypes

        from nanoqwen_kernels.cuda_driver import _error_text, _libcuda

        f = self.fn(name)
        if smem > 48 * 1024 and f.max_dynamic_shared_size_bytes < smem:
            f.max_dynamic_shared_size_bytes = smem
        lib, n = _libcuda(), ctypes.c_int(0)
        rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), ctypes.c_void_p(f.kernel.ptr), ctypes.c_int(block), ctypes.c_size_t(smem)
        )
        if rc != 0:
            raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name}): {_error_text(lib, rc)}")
        return n.value

    def registers(self, name: str) -> int:
        return int(self.fn(name).num_regs)


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------------------------------
# 1. launch cost in a replayed graph
# ---------------------------------------------------------------------------------------------------


def launch_cost(k: CeilingKernels, device: torch.device, replays: int = 200) -> dict:
    """Per-kernel cost of graphs of N kernels: replay / N for N = 1, 32, 256, and the marginal
    (replay(256) - replay(32)) / 224, which leaves the graph's own launch out. Kinds: empty kernels (1
    block of 32 threads; 132 and 528 blocks of 256), empty with 8 arguments, and dep_increment (a
    read-modify-write of one counter: each kernel depends on the last; the count is checked)."""
    sms = sm_count(device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    p = np.uint64(counter.data_ptr())
    kinds = {
        "empty 1x32": ("empty_kernel", (1, 1, 1), (32, 1, 1), ()),
        f"empty {sms}x256": ("empty_kernel", (sms, 1, 1), (256, 1, 1), ()),
        f"empty {4 * sms}x256": ("empty_kernel", (4 * sms, 1, 1), (256, 1, 1), ()),
        f"empty_args8 {4 * sms}x256": (
            "empty_kernel_args8",
            (4 * sms, 1, 1),
            (256, 1, 1),
            (p, p, p, p, p, p, np.int32(1), np.int32(2)),
        ),
        "dep_increment 1x32": ("dep_increment", (1, 1, 1), (32, 1, 1), (p,)),
        f"dep_increment {4 * sms}x256": ("dep_increment", (4 * sms, 1, 1), (256, 1, 1), (p,)),
    }
    rows = []
    for label, (name, grid, block, args) in kinds.items():
        per_n = {}
        for n in (1, 32, 256):
            g = capture_graph(
                lambda i, name=name, grid=grid, block=block, args=args: k.launch(name, grid, block, args), n
            )
            per_n[n] = median_replay_seconds(g, replays)
            if name == "dep_increment":
                counter.zero_()
                g.replay()
                torch.cuda.synchronize()
                if int(counter.item()) != n:
                    raise RuntimeError(f"{label}: {int(counter.item())} increments after one replay of {n}")
            del g
        rows.append(
            {
                "kind": label,
                "replay_us": {str(n): t * 1e6 for n, t in per_n.items()},
                "per_kernel_us": {str(n): t * 1e6 / n for n, t in per_n.items()},
                "marginal_us": (per_n[256] - per_n[32]) * 1e6 / 224,
            }
        )
    return {"rows": rows, "replays": replays, "timeline": stamp_timeline(k, device, sms)}


def stamp_timeline(k: CeilingKernels, device: torch.device, sms: int, n: int = 64, replays: int = 5) -> dict:
    """%globaltimer at the first block's start and the last block's end of each of `n` kernels in one
    graph: the gap (next first start - previous last end) and pitch (start to start), medians over
    `replays` replays; and the timer's resolution as seen (smallest nonzero step between stamps)."""
    out = {}
    for label, grid, block in (("1x32", 1, 32), (f"{4 * sms}x256", 4 * sms, 256)):
        stamps = torch.zeros(2 * n, dtype=torch.int64, device=device)
        p = np.uint64(stamps.data_ptr())
        g = capture_graph(
            lambda i, grid=grid, block=block, p=p: k.launch(
                "stamp_kernel", (grid, 1, 1), (block, 1, 1), (p, np.int32(i))
            ),
            n,
        )
        gaps, pitches, durs, steps = [], [], [], []
        for _ in range(replays):
            stamps.view(n, 2)[:, 0].fill_(2**63 - 1)
            stamps.view(n, 2)[:, 1].zero_()
            g.replay()
            torch.cuda.synchronize()
            s = stamps.view(n, 2).cpu().numpy().astype(np.float64)
            if (s[:, 0] >= 2**62).any() or (s[:, 1] == 0).any():
                raise RuntimeError(f"stamp timeline {label}: a kernel of the graph left no stamp")
            gaps += list(s[1:, 0] - s[:-1, 1])
            pitches += list(s[1:, 0] - s[:-1, 0])
            durs += list(s[:, 1] - s[:, 0])
            flat = np.unique(s.ravel())
            steps.append(float(np.diff(flat).min()) if flat.size > 1 else float("nan"))
        out[label] = {
            "kernels": n,
            "median_gap_ns": statistics.median(gaps),
            "median_pitch_ns": statistics.median(pitches),
            "median_duration_ns": statistics.median(durs),
            "timer_step_ns": min(steps),
        }
    return out


# ---------------------------------------------------------------------------------------------------
# 4. streaming-read ceiling
# ---------------------------------------------------------------------------------------------------


def stream_configs(sms: int) -> list[dict]:
    """Every (kernel, CTAs per SM, bytes in flight per SM) configuration measured."""
    cfgs = []
    for ctas in (1, 2):
        for kb in IN_FLIGHT_KB:
            u = kb * 1024 // (ctas * VEC_THREADS * 16)
            if u in VEC_UNROLLS and (ctas == 1 or u <= 12):
                cfgs.append(
                    {
                        "name": f"vec u{u} {ctas}cta",
                        "kind": "vec",
                        "kernel": f"stream_vec_u{u}",
                        "ctas_per_sm": ctas,
                        "in_flight_kb": kb,
                        "grid": ctas * sms,
                        "block": VEC_THREADS,
                        "smem": 0,
                    }
                )
        for chunk in (8192, 16384):
            for kb in IN_FLIGHT_KB:
                stages = kb * 1024 // (ctas * chunk)
                if 1 <= stages <= RING_MAX_STAGES and stages * ctas * chunk == kb * 1024:
                    cfgs.append(
                        {
                            "name": f"bulk {chunk // 1024}K x{stages} {ctas}cta",
                            "kind": "bulk",
                            "kernel": "stream_bulk_ring",
                            "ctas_per_sm": ctas,
                            "in_flight_kb": kb,
                            "chunk": chunk,
                            "stages": stages,
                            "grid": ctas * sms,
                            "block": 32 * (1 + RING_CONSUMER_WARPS),
                            "smem": stages * chunk,
                        }
                    )
    # the package's roofline kernel: 8 blocks x 256 threads x 4 loads x 16 B = 128 KB per SM
    cfgs.append(
        {
            "name": "read_xor (package)",
            "kind": "read_xor",
            "kernel": "read_xor_u32x4",
            "ctas_per_sm": READ_BLOCKS_PER_SM,
            "in_flight_kb": 128,
            "grid": None,
            "block": 256,
            "smem": 0,
        }
    )
    return cfgs


def _reader(k: CeilingKernels, cfg: dict, sink: torch.Tensor):
    """fn(view: int32 tensor) that reads the view once with the config's kernel, adding into sink."""
    sp = np.uint64(sink.data_ptr())
    if cfg["kind"] == "vec":

        def run(view):
            k.launch(
                cfg["kernel"],
                (cfg["grid"], 1, 1),
                (cfg["block"], 1, 1),
                (np.uint64(view.data_ptr()), np.uint64(view.numel() // 4), sp),
            )
    elif cfg["kind"] == "bulk":

        def run(view):
            nbytes = view.numel() * 4
            if nbytes % cfg["chunk"]:
                raise ValueError(f"{cfg['name']}: {nbytes} bytes is not a multiple of the chunk")
            k.launch(
                cfg["kernel"],
                (cfg["grid"], 1, 1),
                (cfg["block"], 1, 1),
                (
                    np.uint64(view.data_ptr()),
                    np.uint32(nbytes // cfg["chunk"]),
                    np.uint32(cfg["chunk"]),
                    np.int32(cfg["stages"]),
                    sp,
                ),
                cfg["smem"],
            )
    else:

        def run(view):
            read_xor(view, sink)

    return run


def _checksum_ok(run, cfg, view: torch.Tensor, sink: torch.Tensor) -> None:
    """One pass over `view`; sink must equal torch's sum of its words mod 2^32 (XOR for read_xor)."""
    if cfg["kind"] == "read_xor":  # XOR, checked on 4 MB against numpy (the package's own check)
        view = view[: 1 << 20]
        want = int(np.bitwise_xor.reduce(view.cpu().numpy().view(np.uint32)))
    else:
        want = int(view.sum(dtype=torch.int64).item()) & 0xFFFFFFFF
    sink.zero_()
    run(view)
    torch.cuda.synchronize()
    got = int(sink.item()) & 0xFFFFFFFF
    if got != want:
        raise RuntimeError(
            f"{cfg['name']}: checksum {got:#010x}, torch {want:#010x}: it does not read "
            "every word once; no rate is reported"
        )


def streaming(k: CeilingKernels, device: torch.device, read_bps: float, replays: int = 10) -> dict:
    """Each config: checksum on the 4 GiB buffer, its rate there (median of 10 launches), then the
    time per read at each GEMV size: R reads of disjoint windows of a 1 GiB pool (R x size >= 240 MB, so
    no window is in L2 when read again) in one graph, replay / R (so the graph's per-kernel gap is in
    it, as in the decode graph), and 1 GiB read eagerly."""
    sms = sm_count(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(13)
    big = torch.randint(
        -(2**31), 2**31 - 1, (BIG_BYTES // 4,), dtype=torch.int32, device=device, generator=gen
    )
    pool = torch.randint(
        -(2**31), 2**31 - 1, (POOL_BYTES // 4,), dtype=torch.int32, device=device, generator=gen
    )
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    rows = []
    for cfg in stream_configs(sms):
        row = dict(cfg)
        if cfg["kind"] in ("vec", "bulk"):
            occ = k.occupancy(cfg["kernel"], cfg["block"], cfg["smem"])
            row["occupancy_blocks_per_sm"] = occ
            row["registers"] = k.registers(cfg["kernel"])
            if occ < cfg["ctas_per_sm"]:
                row["error"] = f"only {occ} CTAs fit an SM, the config needs {cfg['ctas_per_sm']}"
                rows.append(row)
                continue
        run = _reader(k, cfg, sink)
        _checksum_ok(run, cfg, big, sink)
        t = event_seconds(lambda run=run, big=big: run(big), reps=10)
        row["big_bytes"] = BIG_BYTES
        row["big_GBps"] = BIG_BYTES / statistics.median(t) / 1e9
        row["big_frac_read_bw"] = BIG_BYTES / statistics.median(t) / read_bps
        sizes = {}
        for label, size in GEMV_SIZES.items():
            r = min(64, POOL_BYTES // size)
            if r * size < L2_ROTATE_BYTES:
                raise RuntimeError(f"{label}: {r} windows of {size} bytes do not rotate past the L2")
            words = size // 4
            g = capture_graph(
                lambda i, run=run, pool=pool, words=words: run(pool[i * words : (i + 1) * words]), r
            )
            sec = median_replay_seconds(g, replays) / r
            del g
            sizes[label] = {
                "bytes": size,
                "windows": r,
                "us": sec * 1e6,
                "GBps": size / sec / 1e9,
                "frac_of_big": size / sec / (row["big_GBps"] * 1e9),
                "frac_read_bw": size / sec / read_bps,
            }
        t1 = statistics.median(event_seconds(lambda run=run, pool=pool: run(pool), reps=5))
        sizes["1GiB"] = {
            "bytes": POOL_BYTES,
            "windows": 1,
            "us": t1 * 1e6,
            "GBps": POOL_BYTES / t1 / 1e9,
            "frac_of_big": POOL_BYTES / t1 / (row["big_GBps"] * 1e9),
            "frac_read_bw": POOL_BYTES / t1 / read_bps,
        }
        row["sizes"] = sizes
        rows.append(row)
    del big, pool
    torch.cuda.empty_cache()
    return {"rows": rows, "read_bps": read_bps, "sizes": GEMV_SIZES}


# ---------------------------------------------------------------------------------------------------
# 5. GEMV compute ceiling
# ---------------------------------------------------------------------------------------------------

COMPUTE_KC = 4  # tile-columns resident per block: 4 x 8 KB of weights, so 4 blocks still fit an SM at M = 8
COMPUTE_BLOCKS_PER_SM = 4
COMPUTE_REPS = (200, 1000)


def compute_smem(m: int, kc: int = COMPUTE_KC) -> int:
    return kc * (8192 + 256 + 128) + m * (kc * 128 + kgemv.XPAD) * 2


def random_int4_weight(n: int, k: int, symmetric: bool, gen: torch.Generator, device) -> kgemv.Int4Weight:
    """A random g128 int4 weight of [n, k] (n a multiple of 8, k of 128) in gemv_int4's packed layout:
    qweight int32 [n / 8, k / 128, 32, 4] of uniform random bytes, scales bf16 [n, k / 128] in
    [0.5, 1.5) / (4.6 sqrt(k)) (outputs of order 1 for x ~ N(0, 1)), zeros uint8 [n, k / 128] in
    [0, 16) unless `symmetric` (then None). Drawn from `gen` on `device` in that order."""
    if n <= 0 or k <= 0 or n % 8 or k % 128:
        raise ValueError(f"n must be a positive multiple of 8 and k of 128, got n={n}, k={k}")
    words = torch.randint(0, 256, (n * k // 2,), generator=gen, device=device, dtype=torch.uint8)
    scales = ((0.5 + torch.rand(n, k // 128, generator=gen, device=device)) / (4.6 * k**0.5)).to(
        torch.bfloat16
    )
    zeros = (
        None
        if symmetric
        else torch.randint(0, 16, (n, k // 128), generator=gen, device=device, dtype=torch.uint8)
    )
    return kgemv.Int4Weight(
        words.view(torch.int32).reshape(n // 8, k // 128, 32, 4), scales, zeros, n, k, 128
    )


# The loop variants measured side by side: kernel-name suffix -> what it is. v1 is gemv_int4's own loop;
# the v2 loops (ceilings/gemv_loop_v2.cuh) must give v1's output bit for bit (checked on the device).
COMPUTE_VARIANTS = {"": "v1 (gemv_int4's loop)", "_v2": "v2, 2 tile-columns per trip",
                    "_v2u1": "v2, 1 tile-column per trip"}  # fmt: skip
V2_CHECK_REPS = (1, 3)  # reps of the bitwise v2 == v1 check, at every M = 1..8


def compute_ceiling(k: CeilingKernels, device: torch.device, read_bps: float) -> dict:
    """Weight bytes per second of the GEMV's dequant + mma loop over resident weights, M = 1 and 8, sym
    and asym, for each loop variant (`COMPUTE_VARIANTS`): (bytes of reps2 - bytes of reps1) / (time
    difference) (the smem fill cancels out), each time the median of 10 launches. Checked first, with
    reps = 1: v1 (every block's fp32 output equal to block 0's, block 0 within the fp32 accumulation
    bound of an fp64 reference, and close to gemv_int4); each v2 variant: its fp32 output [blocks, M,
    128] equal to v1's bit for bit (torch.equal) at every M = 1..8 and reps in `V2_CHECK_REPS`. A
    variant that fails gets an "error" in its rows and no rate. v2 rows also carry `over_v1`, their
    rate over v1's at the same sym/asym and M."""
    from nanoqwen_kernels import reference as R

    sms = sm_count(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(5)
    rows = []
    for symmetric in (True, False):
        w = random_int4_weight(128, COMPUTE_KC * 128, symmetric, gen, device)
        base = f"gemv_compute_g128_{'sym' if symmetric else 'asym'}"
        zp = np.uint64(0 if w.zeros is None else w.zeros.data_ptr())
        # bytes the real GEMV reads per warp-tile-column: 2 tiles x 512 B + 16 bf16 scales (+ 16 zeros)
        per_tc = 1024 + 32 + (0 if symmetric else 16)
        xs = {m: torch.randn(m, w.k, generator=gen, device=device).to(torch.bfloat16) for m in range(1, 9)}

        def run(name, m, reps, out, w=w, zp=zp, xs=xs):
            k.launch(
                name,
                (out.shape[0], 1, 1),
                (256, 1, 1),
                (
                    np.uint64(w.qweight.data_ptr()),
                    np.uint64(w.scales.data_ptr()),
                    zp,
                    np.uint64(xs[m].data_ptr()),
                    np.uint64(out.data_ptr()),
                    np.int32(m),
                    np.int32(COMPUTE_KC),
                    np.int32(reps),
                ),
                compute_smem(m),
            )

        def output(name, m, reps, blocks):
            out = torch.full((blocks, m, 128), float("nan"), dtype=torch.float32, device=device)
            run(name, m, reps, out)
            torch.cuda.synchronize()
            return out

        v1_bps = {}
        for suffix, label in COMPUTE_VARIANTS.items():
            name = base + suffix
            error = None
            if suffix:  # v2: bit for bit v1's output, every M, a few reps (2 blocks: cheap)
                for m in range(1, 9):
                    for reps in V2_CHECK_REPS:
                        a, b = output(base, m, reps, 2), output(name, m, reps, 2)
                        if error is None and not torch.equal(a, b):
                            bad = int((a != b).sum())
                            error = (
                                f"output differs from {base}'s at M={m}, reps={reps} ({bad} of {a.numel()})"
                            )
            for m in (1, 8):
                smem = compute_smem(m)
                occ = k.occupancy(name, 256, smem)
                blocks = sms * min(occ, COMPUTE_BLOCKS_PER_SM)
                row = {
                    "kernel": name,
                    "variant": label,
                    "m": m,
                    "blocks": blocks,
                    "occupancy_blocks_per_sm": occ,
                    "registers": k.registers(name),
                    "smem_bytes": smem,
                }
                if error is not None:
                    rows.append({**row, "error": error})
                    continue
                out = output(name, m, 1, blocks)
                check = _check_compute(out, w, xs[m], R) if not suffix else {"bitwise_equal_v1": True}
                out = torch.full((blocks, m, 128), float("nan"), dtype=torch.float32, device=device)
                t = {
                    r: statistics.median(
                        event_seconds(lambda r=r, name=name, m=m, out=out: run(name, m, r, out), reps=10)
                    )
                    for r in COMPUTE_REPS
                }
                r1, r2 = COMPUTE_REPS
                nbytes = blocks * 8 * COMPUTE_KC * per_tc * (r2 - r1)
                bps = nbytes / (t[r2] - t[r1])
                if not suffix:
                    v1_bps[m] = bps
                row.update(
                    {
                        "reps": list(COMPUTE_REPS),
                        "seconds": [t[r1], t[r2]],
                        "weight_bytes_per_s": bps,
                        "over_read_bw": bps / read_bps,
                        "dequant_is_the_wall": bps / read_bps < 1.3,
                        "check": check,
                    }
                )
                if suffix and m in v1_bps:
                    row["over_v1"] = bps / v1_bps[m]
                rows.append(row)
    return {"rows": rows, "kc": COMPUTE_KC, "read_bps": read_bps, "variants": COMPUTE_VARIANTS}


def _check_compute(out: torch.Tensor, w: kgemv.Int4Weight, x: torch.Tensor, R) -> dict:
    """reps = 1 output [blocks, M, 128] (fp32) against: itself across blocks (bitwise), an fp64 reference
    (bound below), and the real gemv_int4 (bf16 output: + its rounding, 2^-8 relative)."""
    if torch.isnan(out).any():
        raise RuntimeError("gemv_compute left outputs unwritten (NaN poison)")
    if not torch.equal(out, out[:1].expand_as(out)):
        raise RuntimeError("gemv_compute: blocks computed different results from the same tile")
    dense = R.dequantize_int4(w.qweight, w.scales, w.zeros, w.group_size).double().cpu()  # [128, K]
    xd = x.double().cpu()
    ref = xd @ dense.T  # [M, 128]
    # Bound: the products x * (q - z) are exact in fp32 (8 + 4 significant bits); on the way to one
    # output at most K fp32 additions (the 16-term mma sums, the scale fma, the accumulator), each off by
    # at most 2 ulps (2^-22 relative; tensor-core accumulation may truncate instead of rounding) of a
    # partial sum no larger than sum_k |x_k w_k|: |out - ref| <= K * 2^-22 * (|x| @ |w|^T).
    bound = w.k * 2.0**-22 * (xd.abs() @ dense.abs().T)
    got = out[0].double().cpu()
    err = (got - ref).abs()
    if not bool((err <= bound).all()):
        raise RuntimeError(
            f"gemv_compute off the fp64 reference: max error {float(err.max()):.3e}, "
            f"bound there {float(bound.flatten()[int(err.argmax())]):.3e}"
        )
    y = torch.empty(x.shape[0], 128, dtype=torch.bfloat16, device=x.device)
    kgemv.gemv_int4(
        x, w, y, None, kgemv.GemvWorkspace.allocate([kgemv.plan_gemv(128, w.k, x.device)], x.device), None
    )
    torch.cuda.synchronize()
    d_real = (got - y.double().cpu()).abs()
    # both kernels within `bound` of ref, and gemv_int4's bf16 output within 2^-9 relative of its fp32
    # value (round to nearest), itself within ref + bound: 2 bound + 2^-9 (|ref| + bound), doubled margin
    if not bool((d_real <= 2 * bound + 2.0**-8 * (ref.abs() + bound)).all()):
        raise RuntimeError(f"gemv_compute differs from gemv_int4 by {float(d_real.max()):.3e}")
    return {
        "max_err_vs_fp64": float(err.max()),
        "max_bound": float(bound.max()),
        "max_diff_vs_gemv_int4": float(d_real.max()),
        "ref_abs_max": float(ref.abs().max()),
    }
