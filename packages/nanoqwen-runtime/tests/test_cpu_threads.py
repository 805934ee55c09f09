"""The CPU thread count (cpu_threads.py): physical cores of the allowed CPUs, capped by the cgroup quota
and by the CPUs other work keeps busy; each input injected, plus one real affinity mask."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from nanoqwen_runtime.cpu_threads import busy_cpus, cgroup_cpu_limit, choose_threads, physical_cores


def fake_sysfs(root: Path, cores_of: dict[int, int]) -> Path:
    """sysfs topology: CPU -> core id, one package (two CPUs on one core are SMT siblings)."""
    for cpu, core in cores_of.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def cgroup_v2(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(text + "\n")
    return root


def test_smt_siblings_count_once(tmp_path):
    sysfs = fake_sysfs(tmp_path / "cpu", {0: 0, 1: 1, 2: 0, 3: 1})  # 4 CPUs, 2 cores
    assert physical_cores([0, 1, 2, 3], sysfs) == 2
    assert physical_cores([0, 2], sysfs) == 1  # two siblings of one core
    none = tmp_path / "cgroup-none"
    none.mkdir()
    c = choose_threads(affinity=[0, 1, 2, 3], cgroup_root=none, sysfs_cpu=sysfs, busy=0.0)
    assert c.threads == 2 and c.why == "2 physical cores of 4 allowed CPUs"


def test_affinity_mask_caps_the_count(tmp_path):
    sysfs = fake_sysfs(tmp_path / "cpu", {i: i for i in range(8)})
    none = tmp_path / "cgroup-none"
    none.mkdir()
    assert choose_threads(affinity=[3], cgroup_root=none, sysfs_cpu=sysfs, busy=0.0).threads == 1
    assert choose_threads(affinity=[1, 5, 6], cgroup_root=none, sysfs_cpu=sysfs, busy=0.0).threads == 3


@pytest.mark.parametrize(("cpu_max", "quota", "threads"), [
    ("max 100000", None, 8),          # no limit
    ("250000 100000", 2.5, 2),        # 2.5 CPUs: 2 threads
    ("50000 100000", 0.5, 1),         # half a CPU: still 1 thread
])
def test_cgroup_v2_quota(tmp_path, cpu_max, quota, threads):
    sysfs = fake_sysfs(tmp_path / "cpu", {i: i for i in range(8)})
    cg = cgroup_v2(tmp_path / "cg", cpu_max)
    assert cgroup_cpu_limit(cg) == quota
    c = choose_threads(affinity=range(8), cgroup_root=cg, sysfs_cpu=sysfs, busy=0.0)
    assert c.threads == threads
    assert ("cgroup quota" in c.why) == (threads < 8)


def test_cgroup_v1_quota(tmp_path):
    cg = tmp_path / "cg"
    (cg / "cpu").mkdir(parents=True)
    (cg / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (cg / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(cg) == 3.0
    (cg / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cgroup_cpu_limit(cg) is None


@pytest.mark.parametrize(("busy", "threads"), [(0.0, 2), (0.4, 2), (0.5, 1), (1.0, 1), (2.0, 1)])
def test_busy_cpus_leave_at_least_one_thread(tmp_path, busy, threads):
    """A job spinning on one of 2 cores (busy ~1.0) leaves 1 thread; half a CPU busy rounds up."""
    sysfs = fake_sysfs(tmp_path / "cpu", {0: 0, 1: 1})
    none = tmp_path / "cgroup-none"
    none.mkdir()
    c = choose_threads(affinity=[0, 1], cgroup_root=none, sysfs_cpu=sysfs, busy=busy)
    assert c.threads == threads
    assert ("busy with other work" in c.why) == (threads < 2)


def test_busy_cpus_reads_proc_stat_per_allowed_cpu(tmp_path):
    """busy_cpus sums the busy fraction of the allowed CPUs; `nice` time does not count as busy."""
    # per CPU: user nice system idle iowait irq softirq steal
    times = iter(["cpu0 100 0 0 100 0 0 0 0\ncpu1 0 50 0 150 0 0 0 0\n",
                  "cpu0 200 0 0 100 0 0 0 0\ncpu1 0 150 0 150 0 0 0 0\n"])

    class Stat:  # two reads: cpu0 fully busy in between, cpu1 busy only with a niced job
        def read_text(self):
            return next(times)

    assert busy_cpus([0, 1], window_s=0.0, proc_stat=Stat()) == 1.0
    assert busy_cpus([0], window_s=0.0, proc_stat=tmp_path / "missing") is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity masks")
def test_real_affinity_mask_of_one_cpu():
    """A process pinned to one CPU (os.sched_setaffinity) chooses 1 thread, saying so."""
    cpu = min(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{cpu}}}); "
            "from nanoqwen_runtime.cpu_threads import choose_threads; c = choose_threads(busy=0.0); "
            "print(c.threads, '|', c.why)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    threads, why = out.strip().split(" | ")
    assert threads == "1" and why.startswith("1 physical core of 1 allowed CPU"), out


def test_apply_threads_takes_the_option_then_omp_num_threads(monkeypatch):
    import torch
    from nanoqwen_runtime.cpu_threads import ThreadChoice, apply_threads

    old = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert apply_threads(2) == ThreadChoice(2, "--threads") and torch.get_num_threads() == 2
        assert apply_threads(None) == ThreadChoice(1, "OMP_NUM_THREADS") and torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        chosen = apply_threads(None)
        assert chosen.why != "OMP_NUM_THREADS" and torch.get_num_threads() == chosen.threads >= 1
    finally:
        torch.set_num_threads(old)
