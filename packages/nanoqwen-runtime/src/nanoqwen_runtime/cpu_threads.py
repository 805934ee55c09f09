"""How many threads the CPU reference backend computes with, chosen for a shared machine.

    choice = choose_threads()            # ThreadChoice(threads, why)
    torch.set_num_threads(choice.threads)

The rule, each step a cap on the one before:
  1. physical cores: the distinct (package, core) pairs among the CPUs this process may run on; SMT
     siblings share one core's floating-point units and caches, so a second thread on them adds
     little to a memory-bound matmul and costs a barrier per op;
  2. the CPUs of the affinity mask (`os.sched_getaffinity(0)`: taskset, cpuset, a container's CPUs);
  3. the cgroup CPU quota, rounded down, at least 1 (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us /
     cpu.cfs_period_us`): a container limited to 2 CPUs of a 64-core host gets 2 threads, not 64 that
     the kernel throttles;
  4. the CPUs other jobs keep busy now: the busy time of the allowed CPUs in /proc/stat over
     `SAMPLE_S` (taken before the model computes anything; niced jobs excluded: `_cpu_times`), in
     CPUs, rounded half up; at least 1 thread is left. torch's threads wait for each other at every
     op, so one thread descheduled by another job stalls them all: on a 2-core machine with one core
     busy, 2 threads decode several times slower than 1 (figures in packages/nanoqwen-cli/README.md),
     while 1 thread on an idle 2-core machine loses far less. The 1-minute load average was the
     other candidate and is not used: it trails a job that started less than a minute ago, it counts
     this program's own previous run (a second `generate` right after a first would see a busy core
     that is idle), and it is system-wide, not the allowed CPUs'. A burst sampled by chance can cost
     a thread for one run; `--threads N` (or OMP_NUM_THREADS) overrides the rule.
An explicit count (the CLI's `--threads`) is used as given; OMP_NUM_THREADS, when set, is the user's
explicit count too.

Every input is injectable (tests): `affinity`, `cgroup_root`, `sysfs_cpu`, `busy` (in CPUs).
Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ThreadChoice", "choose_threads", "physical_cores", "cgroup_cpu_limit", "busy_cpus",
           "apply_threads"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
SYSFS_CPU = Path("/sys/devices/system/cpu")
PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class ThreadChoice:
    """threads: the count to give torch; why: how it was reached, in words (printed by the CLI)."""

    threads: int
    why: str


def physical_cores(cpus: Iterable[int], sysfs_cpu: Path = SYSFS_CPU) -> int:
    """Distinct physical cores among `cpus` (SMT siblings count once), from sysfs topology; each CPU
    whose topology cannot be read counts as a core of its own."""
    cores: set[tuple[str, ...]] = set()
    for cpu in cpus:
        topo = sysfs_cpu / f"cpu{cpu}" / "topology"
        try:
            key = (topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()
        except OSError:
            key = ("cpu", str(cpu))
        cores.add(key)
    return len(cores)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota in CPUs (e.g. 2.5), or None when unlimited or unreadable. cgroup v2 `cpu.max`
    ("max 100000" or "250000 100000"), else v1 `cpu/cpu.cfs_quota_us` (-1: none) and `cfs_period_us`."""
    v2 = _read(cgroup_root / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                quota, period = int(parts[0]), int(parts[1])
            except ValueError:
                return None
            return quota / period if quota > 0 and period > 0 else None
        return None
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quota = _read(cgroup_root / sub / "cpu.cfs_quota_us")
        period = _read(cgroup_root / sub / "cpu.cfs_period_us")
        if quota is None or period is None:
            continue
        try:
            q, p = int(quota), int(period)
        except ValueError:
            return None
        return q / p if q > 0 and p > 0 else None
    return None


SAMPLE_S = 0.2  # the window busy CPUs are measured over: a few scheduler ticks on every CPU


def _cpu_times(proc_stat: Path) -> dict[int, tuple[int, int]]:
    """{cpu: (busy jiffies, total jiffies)} from /proc/stat's per-CPU lines. Idle and iowait are idle;
    `nice` (processes of nice > 0) is not counted busy: the scheduler gives such a job a small share
    of a CPU against a thread of nice 0 (about 1/10 at nice 10), so it barely slows our threads."""
    out = {}
    for line in proc_stat.read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        t = [int(x) for x in fields[:8]]
        idle = t[1] + t[3] + t[4]  # nice, idle, iowait
        out[int(name[3:])] = (sum(t) - idle, sum(t))
    return out


def busy_cpus(cpus: Iterable[int], window_s: float = SAMPLE_S, proc_stat: Path = PROC_STAT) -> float | None:
    """How many of `cpus` other work keeps busy: their busy fraction over `window_s`, summed (a
    spinning job on one CPU: about 1.0). None when /proc/stat cannot be read. This process sleeps
    during the window, so its own time is not counted."""
    try:
        t0 = _cpu_times(proc_stat)
        time.sleep(window_s)
        t1 = _cpu_times(proc_stat)
    except (OSError, ValueError):
        return None
    busy = 0.0
    for cpu in cpus:
        if cpu in t0 and cpu in t1:
            total = t1[cpu][1] - t0[cpu][1]
            if total > 0:
                busy += (t1[cpu][0] - t0[cpu][0]) / total
    return busy


def choose_threads(*, affinity: Iterable[int] | None = None, cgroup_root: Path = CGROUP_ROOT,
                   sysfs_cpu: Path = SYSFS_CPU, busy: float | None = None) -> ThreadChoice:
    """The thread count by the module header's rule. None inputs are read from this machine
    (`os.sched_getaffinity(0)`, /sys/fs/cgroup, sysfs topology, `busy_cpus` over /proc/stat)."""
    cpus = sorted(affinity if affinity is not None else os.sched_getaffinity(0))
    n_cpus = len(cpus)
    cores = physical_cores(cpus, sysfs_cpu)
    threads = cores
    why = [f"{cores} physical core{'s' * (cores != 1)} of {n_cpus} allowed CPU{'s' * (n_cpus != 1)}"]
    quota = cgroup_cpu_limit(cgroup_root)
    if quota is not None and max(1, math.floor(quota)) < threads:
        threads = max(1, math.floor(quota))
        why.append(f"cgroup quota {quota:g} CPUs")
    if busy is None:
        busy = busy_cpus(cpus)
    if busy is not None:
        taken = math.floor(busy + 0.5)
        if taken and max(1, n_cpus - taken) < threads:
            threads = max(1, n_cpus - taken)
            why.append(f"{busy:.1f} CPUs busy with other work")
    return ThreadChoice(threads, ", ".join(why))


def apply_threads(requested: int | None) -> ThreadChoice:
    """Set torch's intra-op threads: `requested` when given, else OMP_NUM_THREADS when set, else
    `choose_threads()`. Returns what was set and why."""
    import torch

    if requested is not None:
        choice = ThreadChoice(requested, "--threads")
    elif os.environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        choice = ThreadChoice(int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS")
    else:
        choice = choose_threads()
    torch.set_num_threads(choice.threads)
    return choice
