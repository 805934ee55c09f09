"""Where the server's two processes run: two hardware threads of their own for the engine process,
every other allowed CPU for the HTTP process.

    allowed CPUs (sched_getaffinity)  ->  physical cores (sysfs thread_siblings_list)
        auto:  engine = the last cores (whole, with their SMT siblings) until it has ENGINE_CPUS
               hardware threads; http = the rest, if that leaves it MIN_HTTP_CPUS or more
        else, or off:  no placement (the kernel scheduler places both)

Why: the engine's step is host-bound on small models (Python scheduling, graph replay, token read-back:
~3 ms per decode step of the 0.5B at batch 32, about half of it Python). The HTTP process streams
every token (SSE framing, socket writes: ~0.3-0.5 of a core at 32 streams) and wakes on every step
message; when the scheduler runs it where the engine's thread was, or migrates that thread, the
engine's steps slow down (measured: the server's decode steps ran 0.13-0.21 ms slower than the same
engine's alone). The engine process gets two hardware threads, the configuration every overhead
figure in bench/RESULTS.md was measured with: torch's own threads and the kernel's work on the
process's behalf run beside the stepping thread, which sends each step's message itself, inside the
next step (engine_worker.py).

The last cores are taken rather than the first because the first CPUs of a host usually take the
most interrupts. One server per GPU on a host: each engine process takes the slot of its GPU (`slot`
k = the k-th group of ENGINE_CPUS hardware threads from the end; `device_slot` maps cuda:N, through
CUDA_VISIBLE_DEVICES when that lists GPU numbers, to the GPU's number), so that two servers do not
share one pair. Each HTTP process still takes every CPU outside its own engine's. Placement is
advisory: other processes of the machine may still run on the engine's CPUs (affinity binds our
threads, it does not reserve a core).

Linux only (sched_setaffinity, sysfs); elsewhere `plan` returns None. A CPU whose topology cannot be
read counts as a core of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENGINE_CPUS", "MIN_HTTP_CPUS", "CpuPlacement", "apply", "device_slot", "format_cpus",
           "parse_cpu_list", "physical_cores", "plan"]

ENGINE_CPUS = 2     # hardware threads for the engine process (see the module header)
MIN_HTTP_CPUS = 2   # fewer left for the HTTP process (and a client on the same host): no placement
SYS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CpuPlacement:
    """The CPUs of each process (disjoint, both non-empty)."""

    engine: tuple[int, ...]
    http: tuple[int, ...]

    def describe(self) -> str:
        return f"engine process on CPUs {format_cpus(self.engine)}, HTTP on {format_cpus(self.http)}"


def parse_cpu_list(text: str) -> list[int]:
    """sysfs / cpuset list syntax ("0-3,8,10-11") -> sorted CPU ids. Raises ValueError when malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        a, b = int(lo), int(hi) if sep else int(lo)
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(a, b + 1))
    return sorted(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def physical_cores(cpus: Iterable[int], sys_cpu: Path = SYS_CPU) -> list[tuple[int, ...]]:
    """Group `cpus` by physical core (SMT siblings together), in order of each core's lowest CPU. Only
    CPUs in `cpus` appear (a sibling outside the allowed set is left out), each in one core."""
    allowed = set(cpus)
    cores: list[tuple[int, ...]] = []
    taken: set[int] = set()
    for c in sorted(allowed):
        if c in taken:
            continue
        try:
            text = (sys_cpu / f"cpu{c}" / "topology" / "thread_siblings_list").read_text()
            siblings = tuple(s for s in parse_cpu_list(text) if s in allowed and s not in taken)
        except (OSError, ValueError):
            siblings = ()
        if c not in siblings:  # unreadable or inconsistent topology: a core of its own
            siblings = (c,)
        cores.append(siblings)
        taken.update(siblings)
    return cores


def plan(mode: str, allowed: Iterable[int] | None = None, sys_cpu: Path = SYS_CPU,
         slot: int = 0) -> CpuPlacement | None:
    """The placement for `mode` ("auto" or "off") on the CPUs this process may use (default: its
    affinity mask), the engine taking group `slot` (0: the last cores; see the module header). None:
    no placement (off, not Linux, no such group, or too few CPUs left for the HTTP process)."""
    if mode not in ("auto", "off"):
        raise ValueError(f"CPU placement must be 'auto' or 'off', got {mode!r}")
    if slot < 0:
        raise ValueError(f"slot must be >= 0, got {slot}")
    if mode == "off" or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else set(allowed))
    groups: list[list[int]] = [[]]
    for core in reversed(physical_cores(cpus, sys_cpu)):
        if len(groups[-1]) >= ENGINE_CPUS:
            if len(groups) > slot:
                break
            groups.append([])
        groups[-1].extend(core)
    if len(groups) <= slot or len(groups[slot]) < ENGINE_CPUS:
        return None
    engine = groups[slot]
    http = tuple(c for c in cpus if c not in engine)
    if len(http) < MIN_HTTP_CPUS:
        return None
    return CpuPlacement(engine=tuple(sorted(engine)), http=http)


def device_slot(device: str, environ: dict[str, str] | None = None) -> int:
    """The placement slot of a server on `device` ("cuda", "cuda:N"): the GPU's number, read through
    CUDA_VISIBLE_DEVICES when that is a list of numbers (CUDA_VISIBLE_DEVICES=3 and cuda:0 -> 3), else
    N. 0 for anything else."""
    env = os.environ if environ is None else environ
    _, _, index = device.partition(":")
    n = int(index) if index.isdigit() else 0
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if n < len(visible) and visible[n].isdigit():
        return int(visible[n])
    return n


def apply(cpus: Iterable[int]) -> None:
    """Bind every thread of this process, and those it creates later, to `cpus`. Raises OSError when
    the kernel refuses (e.g. a CPU outside this container's cpuset)."""
    mask = set(cpus)
    tids = [0]
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        pass
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    os.sched_setaffinity(0, mask)  # the calling thread last: the one that creates the next threads
