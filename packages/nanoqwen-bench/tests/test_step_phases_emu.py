"""bench.cu's `step_phases_u32x4` and `step_phases_preload_u32x4` (the persistent decode kernel's
streaming ceiling) on the CPU emulator (nanoqwen_kernels.testing.emu: the kernel's CUDA source compiled
for the host, every CTA on a thread of its own, all resident at once, as the grid barrier needs). Phases
of odd sizes (empty, fewer vectors than CTAs, a tail, more than mode 3 preloads): in every mode the sink
is the XOR of exactly the words of the launched phases; the grid barrier ran once between phases (its
generation counts them) and let no CTA through early (every CTA checks every other's arrival flag after
it); its arrival count is back at zero, so a second launch on the same state works. Bad arguments are
refused before any launch."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from nanoqwen_bench import gpu

CPU = torch.device("cpu")
PHASE_VECS = [37, 0, 3, 1024 + 5, 2, 700, 5 * 4 * 512 + 777]  # 16-byte vectors per phase; the last
# gives each CTA more than 4 vectors per thread (mode 3 preloads 4, then walks the rest)
BLOCKS = 5


@pytest.fixture
def emulated(monkeypatch):
    from nanoqwen_kernels.testing import emu

    emu.compiler()  # the emulator needs g++: a missing compiler is an error here, not a skip
    monkeypatch.setattr(gpu, "launch", emu.launch)
    monkeypatch.setattr(gpu, "require_sm90", lambda device: 0)
    with emu.emulated(seed=7, timeout_s=120.0):
        yield


def phases(request):
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    bounds = torch.tensor(np.cumsum([3, *PHASE_VECS]), dtype=torch.int64)  # the first phase at vector 3
    data = torch.randint(-(2**31), 2**31 - 1, (int(bounds[-1]) * 4 + 8,), generator=g, dtype=torch.int32)
    return data, bounds


def xor_of(data, bounds, first, last):
    words = data[int(bounds[first]) * 4 : int(bounds[last]) * 4].numpy().view(np.uint32)
    return int(np.bitwise_xor.reduce(words).view(np.int32)) if words.size else 0


@pytest.mark.parametrize("mode", [gpu.PHASES_BACK_TO_BACK, gpu.PHASES_BARRIER, gpu.PHASES_BARRIER_PREFETCH,
                                  gpu.PHASES_BARRIER_PRELOAD])
def test_every_phase_is_read_once_and_the_barrier_holds(mode, emulated, request):
    data, bounds = phases(request)
    n = len(PHASE_VECS)
    sink, bar = torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    flags, errors = torch.zeros(BLOCKS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    gpu.step_phases(data, bounds, sink, bar, blocks=BLOCKS, mode=mode, prefetch_bytes=512,
                    check_flags=flags, check_errors=errors)
    assert int(sink) == xor_of(data, bounds, 0, n)
    barriers = 0 if mode == gpu.PHASES_BACK_TO_BACK else n - 1
    assert bar.tolist() == [0, barriers]  # arrivals back at zero; one generation per barrier
    assert int(errors) == 0
    assert flags.tolist() == ([barriers] * BLOCKS if barriers else [0] * BLOCKS)

    gpu.step_phases(data, bounds, sink, bar, blocks=BLOCKS, mode=mode, phases=slice(2, 5))
    assert int(sink) == xor_of(data, bounds, 0, n) ^ xor_of(data, bounds, 2, 5)
    assert bar.tolist() == [0, barriers + (2 if barriers else 0)]


def test_bad_arguments_are_refused(monkeypatch):
    data, bounds = torch.zeros(64, dtype=torch.int32), torch.tensor([0, 4, 16], dtype=torch.int64)
    sink, bar = torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)

    def call(**kw):
        args = {"data": data, "bounds": bounds, "sink": sink, "bar": bar, "blocks": 2, "mode": 1} | kw
        gpu.step_phases(args.pop("data"), args.pop("bounds"), args.pop("sink"), args.pop("bar"), **args)

    monkeypatch.setattr(gpu, "require_sm90", lambda device: 0)
    for kw, match in [({"mode": 4}, "mode 4"), ({"prefetch_bytes": 8}, "multiple of 16"),
                          ({"blocks": 0}, "blocks > 0"), ({"phases": slice(1, 1)}, "non-empty"),
                      ({"phases": slice(0, 2, 2)}, "step-1"), ({"bounds": bounds.int()}, "bounds"),
                      ({"bar": torch.zeros(3, dtype=torch.int32)}, "bar"),
                      ({"check_flags": torch.zeros(2, dtype=torch.int32)}, "go together")]:
        with pytest.raises((ValueError, TypeError), match=match):
            call(**kw)


def group_sizes(groups, blocks):
    """CTAs per group: CTA c is in group c * groups // blocks (bench.cu's step_phases_dataflow)."""
    return np.bincount([c * groups // blocks for c in range(blocks)], minlength=groups).tolist()


@pytest.mark.parametrize("groups,slots", [(1, 2), (2, 3), (BLOCKS, 1), (3, 12)])
def test_dataflow_reads_every_phase_once_and_waits_for_its_groups(groups, slots, emulated, request):
    """step_phases_dataflow: the sink is the XOR of every phase's words (each piece through the ring
    once, whatever its depth); every counter ends at its group's size (each CTA counted each phase
    once); no CTA consumed a part before every CTA of the part's group had finished the previous phase
    (the progress check). A second launch on zeroed counters reads it all again."""
    data, bounds = phases(request)
    n = len(PHASE_VECS)
    sink, counters = torch.zeros(1, dtype=torch.int32), torch.zeros(n * groups, dtype=torch.int32)
    progress, errors = torch.zeros(BLOCKS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    gpu.step_phases_dataflow(data, bounds, sink, counters, blocks=BLOCKS, groups=groups, slots=slots,
                             progress=progress, check_errors=errors)
    assert int(sink) == xor_of(data, bounds, 0, n)
    assert counters.view(n, groups).tolist() == [group_sizes(groups, BLOCKS)] * n
    assert int(errors) == 0 and progress.tolist() == [n] * BLOCKS
    counters.zero_()
    gpu.step_phases_dataflow(data, bounds, sink, counters, blocks=BLOCKS, groups=groups, slots=slots)
    assert int(sink) == 0  # read twice: the XOR cancels


def test_dataflow_bad_arguments_are_refused(monkeypatch):
    data, bounds = torch.zeros(64, dtype=torch.int32), torch.tensor([0, 4, 16], dtype=torch.int64)
    sink, counters = torch.zeros(1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)

    def call(**kw):
        args = {"counters": counters, "blocks": 2, "groups": 2} | kw
        gpu.step_phases_dataflow(data, bounds, sink, args.pop("counters"), **args)

    monkeypatch.setattr(gpu, "require_sm90", lambda device: 0)
    for kw, match in [({"groups": 3}, "groups 3"), ({"groups": 0}, "groups 0"), ({"slots": 13}, "slots 13"),
                      ({"counters": torch.zeros(3, dtype=torch.int32)}, "counters"),
                      ({"progress": torch.zeros(2, dtype=torch.int32)}, "go together")]:
        with pytest.raises((ValueError, TypeError), match=match):
            call(**kw)
