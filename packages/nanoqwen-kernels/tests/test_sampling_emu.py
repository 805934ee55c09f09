"""The sampling kernel on the CPU emulator (nanoqwen_kernels.testing.emu: the kernel's own CUDA source
compiled for the host, 1024 fibers per block switched at its shuffles, ballots and barriers and at random at
its shared-memory atomics; the blocks of a row running at once, in any order, to meet on the row's
arrival counter). The checks are sampling_testkit.py's, the GPU tests' own, with fresh random logits
(a generator seeded by the test's name) at smaller sizes: greedy with ties and NaN, greedy over
several blocks per row (chunk edges, a tie across chunks, counters back at zero, three launches),
top-k = 1, top-k / top-p tokens inside the reference set, the distribution of 256 draws (chi-square,
the GPU test's bound), and (seed, offset) reproducing a draw.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from nanoqwen_kernels.testing import emu
from sampling_testkit import (
    check_distribution_matches_reference,
    check_greedy_across_chunks,
    check_greedy_is_argmax_with_ties,
    check_samples_lie_in_reference_set,
    check_seed_offset_reproduce,
    check_top_k_1_keeps_only_the_maximum,
)

pytestmark = pytest.mark.usefixtures("emu_compiler")
CPU = torch.device("cpu")
TIMEOUT_S = 60.0


@pytest.fixture
def cpu_gen(request):
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


@pytest.mark.parametrize("b,v", [(3, 1000), (2, 8 * 1024 * 2 + 8)])
def test_greedy_is_argmax_with_ties(b, v, cpu_gen):
    with emu.emulated(seed=b, timeout_s=TIMEOUT_S):
        check_greedy_is_argmax_with_ties(b, v, cpu_gen, CPU)


def test_greedy_across_chunks(cpu_gen):
    """V = 3 x 8192 + 8: 4 blocks per row."""
    with emu.emulated(seed=1, timeout_s=TIMEOUT_S):
        check_greedy_across_chunks(8 * 1024 * 3 + 8, cpu_gen, CPU)


def test_top_k_1_keeps_only_the_maximum(cpu_gen):
    with emu.emulated(seed=2, timeout_s=TIMEOUT_S):
        check_top_k_1_keeps_only_the_maximum(cpu_gen, CPU, b=4, v=8 * 1024 * 2 + 8)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 50, 1.0), (0.7, 0, 0.9), (1.3, 40, 0.8), (0.6, 0, 0.5)]
)
def test_samples_lie_in_reference_set(temperature, top_k, top_p, cpu_gen):
    with emu.emulated(seed=3, timeout_s=TIMEOUT_S):
        check_samples_lie_in_reference_set(temperature, top_k, top_p, cpu_gen, CPU, b=4, v=8 * 1024 + 64,
                                           launches=2)


def test_distribution_matches_reference(cpu_gen):
    """Temperature, top-k and top-p at once; 256 rows (one block of 1024 threads each)."""
    with emu.emulated(seed=4, timeout_s=TIMEOUT_S):
        check_distribution_matches_reference(1.5, 30, 0.9, cpu_gen, CPU, b=256, v=64)


def test_seed_offset_reproduce(cpu_gen):
    with emu.emulated(seed=5, timeout_s=TIMEOUT_S):
        check_seed_offset_reproduce(cpu_gen, CPU, b=8, v=5000)
