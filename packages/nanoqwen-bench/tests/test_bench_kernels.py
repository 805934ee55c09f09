"""GPU: the benchmark kernels (nanoqwen-kernels' csrc/bench.cu, launched by nanoqwen_bench.gpu). read_xor
reads every word (its XOR equals numpy's, at odd sizes and at several MB), refuses inputs it cannot read with
16-byte loads; spin holds the stream for at least the asked time; read_bandwidth reports a rate only after its
own correctness check; l2_prefetch changes no byte of what it prefetches (any length, a tail shorter than its
chunk) and refuses ranges a bulk prefetch cannot take; step_phases, on a grid filling every SM, reads every
phase once and its grid barrier lets no CTA through early."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def words(n, gen, device):
    return torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int32, device=device)


@pytest.mark.parametrize("n_words", [4, 4 * 1001, 4 * 257 * 33, (1 << 22) + 12])
def test_read_xor_is_the_xor_of_every_word(n_words, gen, device):
    from nanoqwen_bench.gpu import read_xor

    data = words(n_words, gen, device)
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    read_xor(data, sink)
    want = np.bitwise_xor.reduce(data.cpu().numpy().view(np.uint32)).view(np.int32)
    assert int(sink.item()) == int(want)
    read_xor(data, sink)  # XOR-accumulates: twice over the same data gives 0
    assert int(sink.item()) == 0


def test_read_xor_refuses_what_it_cannot_read(gen, device):
    from nanoqwen_bench.gpu import read_xor

    data = words(64, gen, device)
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    for bad in (data[1:5], data[:6], data.view(8, 8)[:, :4]):
        with pytest.raises(ValueError, match="16-byte"):
            read_xor(bad, sink)
    with pytest.raises(TypeError):
        read_xor(data, torch.zeros(1, dtype=torch.int64, device=device))


@pytest.mark.parametrize("n_words,chunk", [(4, 16), (4 * 1001, 1 << 10), ((1 << 22) + 12, 32 << 10)])
@pytest.mark.parametrize("evict_last", [False, True])
def test_l2_prefetch_changes_nothing(n_words, chunk, evict_last, gen, device):
    from nanoqwen_bench.gpu import l2_prefetch

    data = words(n_words, gen, device)
    before = data.clone()
    l2_prefetch(data, chunk=chunk, evict_last=evict_last)
    torch.cuda.synchronize(device)
    assert torch.equal(data, before)


def test_l2_prefetch_refuses_what_a_bulk_prefetch_cannot_take(gen, device):
    from nanoqwen_bench.gpu import l2_prefetch

    data = words(64, gen, device)
    for bad in (data[1:5], data[:6], data.view(8, 8)[:, :4]):
        with pytest.raises(ValueError, match="16-byte"):
            l2_prefetch(bad)
    for chunk in (0, 24):
        with pytest.raises(ValueError, match="chunk"):
            l2_prefetch(data, chunk=chunk)


def test_spin_holds_the_stream(device):
    from nanoqwen_bench.gpu import spin

    spin(0, device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    spin(3_000_000, device)
    b.record()
    b.synchronize()
    assert a.elapsed_time(b) >= 2.9  # ms


def test_read_bandwidth_reports_a_plausible_rate(device):
    from nanoqwen_bench.gpu import read_bandwidth

    r = read_bandwidth(device, nbytes=512 << 20, reps=5)
    assert r["nbytes"] == 512 << 20 and r["min_s"] <= r["median_s"] <= r["max_s"]
    assert 0.5e12 < r["bytes_per_s"] < 10e12  # H100 / H200 HBM: a few TB/s


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("kernel", ["tinygemm", "gemlite"])
def test_baseline_computes_the_dequantized_product(kernel, m, device):
    """The other INT4 kernels the benches time (baselines.py) compute the product they claim: within the
    bound at odd M (gemlite runs another kernel per M class), and the check catches a weight whose
    values it was not told (another random weight's). At the 7B's qkv shape, which gemlite's shipped
    H100 configs cover: it runs where it is installed and tuned (its autotune takes a minute a shape)."""
    from nanoqwen_bench.kernels import baselines

    n, k = 4608, 3584
    if kernel == "gemlite":
        timed, why = baselines.gemlite_plan(n, k, [m])
        if not timed:
            pytest.skip(why)
    make = getattr(baselines, f"random_{kernel}_weight")
    check = getattr(baselines, f"check_{kernel}")
    gen = torch.Generator(device="cuda").manual_seed(m)
    w = make(n, k, gen, keep_values=True)
    check(w, m, gen)
    w.q = make(n, k, gen, keep_values=True).q
    with pytest.raises(AssertionError, match=kernel):
        check(w, m, gen)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_step_phases_reads_every_phase_once_across_the_whole_chip(mode, gen, device):
    """The persistent grid at full residency (every SM): the XOR of all phases, one barrier generation
    per phase boundary, no CTA through a barrier early; then the same state launched again. The last
    phase gives every thread more than the 4 vectors mode 3 preloads."""
    from nanoqwen_bench import gpu

    vecs = [5, 0, 1000, 3, 70_001, 130, 4096 * 33 + 7, 1_200_003]
    bounds = torch.tensor([0, *np.cumsum(vecs)], dtype=torch.int64, device=device)
    data = words(int(bounds[-1]) * 4, gen, device)
    blocks = torch.cuda.get_device_properties(device).multi_processor_count * gpu.resident_blocks(
        gpu.step_phases_kernel(mode), gpu.STEP_PHASES_THREADS, device)
    sink, bar, errors, flags = (torch.zeros(n, dtype=torch.int32, device=device) for n in (1, 2, 1, blocks))
    gpu.step_phases(data, bounds, sink, bar, blocks=blocks, mode=mode, prefetch_bytes=4096, check_flags=flags,
                    check_errors=errors)
    want = np.bitwise_xor.reduce(data.cpu().numpy().view(np.uint32)).view(np.int32)
    barriers = 0 if mode == 0 else len(vecs) - 1
    assert int(sink.item()) == int(want)
    assert bar.tolist() == [0, barriers] and int(errors.item()) == 0
    gpu.step_phases(data, bounds, sink, bar, blocks=blocks, mode=mode)
    assert int(sink.item()) == 0 and bar.tolist() == [0, 2 * barriers]


@pytest.mark.parametrize("groups", [1, 12, "sms"])
def test_step_phases_dataflow_reads_every_phase_once_across_the_whole_chip(groups, gen, device):
    """The dataflow ceiling's kernel at one CTA per SM with its 12-slot ring: the XOR of all phases,
    every counter at its group's size, no part consumed before its group finished the previous phase;
    then launched again on zeroed counters."""
    from nanoqwen_bench import gpu

    vecs = [5, 0, 1000, 3, 70_001, 130, 4096 * 33 + 7, 1_200_003]
    n = len(vecs)
    bounds = torch.tensor([0, *np.cumsum(vecs)], dtype=torch.int64, device=device)
    data = words(int(bounds[-1]) * 4, gen, device)
    blocks = torch.cuda.get_device_properties(device).multi_processor_count
    groups = blocks if groups == "sms" else groups
    sink, errors, progress = (torch.zeros(k, dtype=torch.int32, device=device) for k in (1, 1, blocks))
    counters = torch.zeros(n * groups, dtype=torch.int32, device=device)
    gpu.step_phases_dataflow(data, bounds, sink, counters, blocks=blocks, groups=groups, progress=progress,
                             check_errors=errors)
    want = np.bitwise_xor.reduce(data.cpu().numpy().view(np.uint32)).view(np.int32)
    sizes = np.bincount(np.arange(blocks) * groups // blocks, minlength=groups).tolist()
    assert int(sink.item()) == int(want) and int(errors.item()) == 0
    assert counters.view(n, groups).tolist() == [sizes] * n and progress.tolist() == [n] * blocks
    counters.zero_()
    gpu.step_phases_dataflow(data, bounds, sink, counters, blocks=blocks, groups=groups)
    assert int(sink.item()) == 0
