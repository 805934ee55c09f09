"""CPU placement of the server's processes (server/cpu_placement.py): the plan from a host's topology
(fake sysfs trees: SMT pairs, no SMT, CPUs missing from the allowed set, unreadable topology), and that
the engine process and the HTTP process really run where the plan puts them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nanoqwen_cli.server.cpu_placement import CpuPlacement, format_cpus, parse_cpu_list, physical_cores, plan
from nanoqwen_cli.server.engine_process import EngineProcess
from nanoqwen_cli.server.fake_engine import FakeEngineSpec
from nanoqwen_cli.server.metrics import Metrics

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


def fake_sysfs(root: Path, siblings: dict[int, str]) -> Path:
    """A /sys/devices/system/cpu tree whose cpuN/topology/thread_siblings_list is siblings[N]."""
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return root


def smt_host(root: Path, cores: int) -> Path:
    """`cores` physical cores with two hardware threads each, numbered like most x86 hosts: core c has
    CPUs c and c + cores."""
    return fake_sysfs(root, {c: f"{c % cores},{c % cores + cores}" for c in range(2 * cores)})


@pytest.mark.parametrize(("text", "cpus"), [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0,8", [0, 8]),
                                            ("0-1,4,6-7\n", [0, 1, 4, 6, 7]), ("3,1", [1, 3])])
def test_parse_and_format_cpu_lists(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpus(cpus)) == cpus


@pytest.mark.parametrize("bad", ["a", "3-1", "-1", "1-x"])
def test_parse_cpu_list_refuses_malformed_text(bad):
    with pytest.raises(ValueError):
        parse_cpu_list(bad)


def test_format_cpus_folds_runs():
    assert format_cpus([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_cpus([]) == ""


def test_physical_cores_groups_smt_siblings(tmp_path):
    root = smt_host(tmp_path, 4)
    assert physical_cores(range(8), root) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # a sibling outside the allowed set is left out; its partner is still one core
    assert physical_cores([0, 1, 5, 6], root) == [(0,), (1, 5), (6,)]


def test_physical_cores_without_topology_counts_each_cpu(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-1", 1: "0-1"})  # cpu2, cpu3 have no topology folder
    assert physical_cores([0, 1, 2, 3], root) == [(0, 1), (2,), (3,)]
    (tmp_path / "cpu0" / "topology" / "thread_siblings_list").write_text("garbage")
    assert physical_cores([0, 1], root) == [(0,), (1,)]  # inconsistent: each CPU in one core only


def test_plan_gives_the_last_core_with_its_siblings_to_the_engine(tmp_path):
    root = smt_host(tmp_path, 8)  # 8 cores x 2 hardware threads
    p = plan("auto", range(16), root)
    assert p == CpuPlacement(engine=(7, 15), http=(0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14))
    assert set(p.engine).isdisjoint(p.http) and set(p.engine) | set(p.http) == set(range(16))
    assert p.describe() == "engine process on CPUs 7,15, HTTP on 0-6,8-14"


def test_plan_without_smt_takes_two_cores(tmp_path):
    """The H200 host of the device tool: 16 vCPUs, each its own core in sysfs."""
    root = fake_sysfs(tmp_path, {c: str(c) for c in range(16)})
    assert plan("auto", range(16), root) == CpuPlacement(engine=(14, 15), http=tuple(range(14)))
    small = fake_sysfs(tmp_path / "four", {c: str(c) for c in range(4)})
    assert plan("auto", range(4), small) == CpuPlacement(engine=(2, 3), http=(0, 1))


def test_plan_leaves_the_http_process_two_cpus(tmp_path):
    root = smt_host(tmp_path, 2)  # 4 CPUs = 2 cores: the engine's whole core leaves 2
    assert plan("auto", range(4), root) == CpuPlacement(engine=(1, 3), http=(0, 2))
    three = fake_sysfs(tmp_path / "three", {c: str(c) for c in range(3)})
    assert plan("auto", range(3), three) is None
    assert plan("auto", [0, 1], fake_sysfs(tmp_path / "b", {0: "0", 1: "1"})) is None  # CI's 2 vCPUs


def test_plan_off_and_bad_mode(tmp_path):
    root = smt_host(tmp_path, 8)
    assert plan("off", range(16), root) is None
    with pytest.raises(ValueError, match="auto' or 'off"):
        plan("on", range(16), root)


@linux_only
def test_apply_binds_every_thread_of_a_process():
    """In a child process: a thread started before `apply` and one started after both end up on the
    CPUs given."""
    cpu = min(os.sched_getaffinity(0))
    code = f"""
import os, threading
from nanoqwen_cli.server import cpu_placement
seen = {{}}
ev = threading.Event()
def early():
    ev.wait(); seen["early"] = os.sched_getaffinity(0)
t = threading.Thread(target=early); t.start()
cpu_placement.apply(({cpu},))
ev.set(); t.join()
late = threading.Thread(target=lambda: seen.__setitem__("late", os.sched_getaffinity(0)))
late.start(); late.join()
print(sorted(seen["early"]), sorted(seen["late"]), sorted(os.sched_getaffinity(0)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[0] == f"[{cpu}] [{cpu}] [{cpu}]"


@linux_only
def test_engine_process_runs_on_its_cpus():
    """EngineProcess(engine_cpus=...) spawns an engine process bound to those CPUs (before it loads),
    while this process keeps its own mask."""
    before = os.sched_getaffinity(0)
    cpu = max(before)

    async def main():
        loop = EngineProcess(FakeEngineSpec(busy_s=0.0, sleep_s=0.001), Metrics(), max_waiting=4,
                             engine_cpus=(cpu,))
        loop.start(asyncio.get_running_loop())
        await asyncio.to_thread(loop.ready.wait, 120)
        assert loop.load_error is None, loop.load_error
        try:
            assert os.sched_getaffinity(loop.engine_pid) == {cpu}
            tasks = os.listdir(f"/proc/{loop.engine_pid}/task")
            assert tasks  # every thread it has, the stepping thread and any the engine started
            assert all(os.sched_getaffinity(int(t)) == {cpu} for t in tasks)
        finally:
            await loop.drain(0.0)

    asyncio.run(main())
    assert os.sched_getaffinity(0) == before


@linux_only
def test_engine_process_refused_cpus_is_a_load_error():
    """A CPU the kernel will not give (outside the host) ends the load with one clear line."""
    bad = 4095

    async def main():
        loop = EngineProcess(FakeEngineSpec(busy_s=0.0, sleep_s=0.001), Metrics(), max_waiting=4,
                             engine_cpus=(bad,))
        loop.start(asyncio.get_running_loop())
        await asyncio.to_thread(loop.ready.wait, 120)
        assert loop.load_error is not None
        assert "cannot bind the engine process to CPUs 4095" in loop.load_error
        assert "--cpu-placement off" in loop.load_error
        await asyncio.to_thread(loop.join, 30.0)

    asyncio.run(main())


def test_serve_refuses_a_bad_cpu_placement(tmp_path):
    from nanoqwen_runtime.testing import write_tiny_container

    model = write_tiny_container(tmp_path / "tiny.nanoqwen")
    out = subprocess.run([sys.executable, "-m", "nanoqwen_cli.main", "serve", str(model), "--cpu-placement",
                          "sometimes"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--cpu-placement must be auto or off" in out.stderr


def test_one_server_per_gpu_takes_the_pair_of_its_gpu(tmp_path):
    """Servers on cuda:0 and cuda:1 of one host take different pairs (slots 0 and 1 from the end); a
    slot past the host's CPUs is no placement."""
    root = fake_sysfs(tmp_path, {c: str(c) for c in range(16)})
    p0, p1 = plan("auto", range(16), root, slot=0), plan("auto", range(16), root, slot=1)
    assert p0.engine == (14, 15) and p1.engine == (12, 13)
    assert p1.http == tuple(c for c in range(16) if c not in (12, 13))
    assert plan("auto", range(16), root, slot=6).engine == (2, 3)
    assert plan("auto", range(16), root, slot=7).engine == (0, 1)  # the first pair: HTTP on 2-15
    assert plan("auto", range(16), root, slot=8) is None  # no ninth pair
    four = fake_sysfs(tmp_path / "four", {c: str(c) for c in range(4)})
    assert plan("auto", range(4), four, slot=1) == CpuPlacement(engine=(0, 1), http=(2, 3))
    assert plan("auto", range(4), four, slot=2) is None

    smt = smt_host(tmp_path / "smt", 8)
    assert plan("auto", range(16), smt, slot=1).engine == (6, 14)  # whole cores, SMT pairs
    with pytest.raises(ValueError, match="slot"):
        plan("auto", range(16), root, slot=-1)


@pytest.mark.parametrize(("device", "visible", "slot"), [
    ("cuda", None, 0), ("cuda:0", None, 0), ("cuda:3", None, 3), ("cuda", "2", 2), ("cuda:1", "4,6", 6),
    ("cuda:0", "GPU-5e3f", 0), ("cuda:2", "1", 2), ("cpu", None, 0)])
def test_device_slot_reads_the_gpu_number(device, visible, slot):
    from nanoqwen_cli.server.cpu_placement import device_slot

    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert device_slot(device, env) == slot


@linux_only
def test_server_refused_cpus_is_one_clear_error():
    """run_server with HTTP CPUs the kernel will not give returns the error before anything starts (in
    a child process: a refusal changes no thread's mask, but the test process's own stays untouched)."""
    code = """
from nanoqwen_cli.server.cpu_placement import CpuPlacement
from nanoqwen_cli.server.fake_engine import FakeEngineSpec
from nanoqwen_cli.server.runner import run_server
err = run_server(FakeEngineSpec(), None, "m", host="127.0.0.1", port=0, api_key=None, max_body_bytes=1,
                 max_waiting=1, drain_timeout_s=1.0, placement=CpuPlacement(engine=(0,), http=(4095,)))
print(err)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert "cannot bind the server to CPUs 4095" in out.stdout and "--cpu-placement off" in out.stdout
