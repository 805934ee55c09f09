"""Checks of the sampling kernel (sampling.py, csrc/sampling.cuh) shared by its GPU tests
(test_sampling.py) and its emulator tests (test_sampling_emu.py: the same checks on the CPU, the
kernel's own source compiled by nanoqwen_kernels.testing.emu). Each `check_*` takes a generator and a device
(the generator on the device); the sizes are arguments, the GPU tests' by default.

What must hold: greedy equals torch.argmax (lowest index among ties; NaN never wins), also when a
row is read by several blocks (the maximum at a chunk's edges, ties across chunks, the arrival
counters back at 0 after every launch); every sampled token lies in the reference top-k/top-p set;
the empirical distribution over many seeds matches the reference (chi-square); offsets advance on
every launch, and a (seed, offset) pair reproduces its token. Outputs are poisoned (-7) first.
"""

from __future__ import annotations

import torch
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.sampling import SamplingState, chunks_per_row, sample_tokens

# Slack on top_p when checking that a sampled token is in the reference's top-p set. The reference
# (nanoqwen_model.sampling) sums the tempered mass in fp64; the kernel in fp32: each weight from
# __expf, <= (2 + 1.17 |x|) ulp off, where the weights that carry mass have |x| = |l - lmax| / T of
# a few units (~1e-6 relative), then summed in chains of <= ~150 adds per thread (152064 / 1024) plus
# 10 tree levels, and into the histogram bins of the 255 bf16 values below the max (the kernel's fast
# path, where every case here resolves top-p): <= ~200 tokens share one value of 3 x N(0, 1) logits
# over 152064 tokens. All terms are positive, so even with every rounding one way the cumulative mass
# at the cut is off by <= ~400 x 2^-24 = 2.4e-5 of the total: a token at the boundary can move by that
# much mass. 1e-3 is 40x it.
TOP_P_SLACK = 1e-3


def make_state(b, device, temperature, top_k, top_p, seed0=1234) -> SamplingState:
    st = SamplingState.allocate(b, device)
    st.temperature.fill_(temperature)
    st.top_k.fill_(top_k)
    st.top_p.fill_(top_p)
    st.seeds.copy_(torch.arange(seed0, seed0 + b, device=device) * 7919)
    return st


def check_greedy_is_argmax_with_ties(b: int, v: int, gen, device) -> None:
    logits = torch.randn(b, v, generator=gen, device=device).to(torch.bfloat16)
    logits[:, v // 3] = 9.0
    logits[:, v // 2] = 9.0  # tie: the lower index wins
    logits[0, 5] = float("nan")  # NaN never wins
    out = torch.full((b,), -7, dtype=torch.int32, device=device)
    st = make_state(b, device, 0.0, 0, 1.0)
    sample_tokens(logits, st, out)
    assert out.tolist() == [v // 3] * b
    assert st.offsets.tolist() == [1] * b


def check_greedy_across_chunks(v: int, gen, device, *, launches: int = 3) -> None:
    """A row read by several blocks (sampling.chunks_per_row): the maximum at either end of a chunk, a
    tie across two chunks (the lower index wins), NaN in every chunk, and rows whose maximum is in the
    first or the last chunk; greedy rows beside sampled ones (top_k = 1: the maximum too, but from the
    last block's full sampling path). The arrival counters are back at 0 after every launch."""
    c = chunks_per_row(v)
    assert c > 1
    edges = [k * (v // 8) // c * 8 for k in range(c + 1)]  # chunk boundaries in elements
    b = 6
    logits = torch.randn(b, v, generator=gen, device=device).to(torch.bfloat16)
    logits[:, edges[1:-1]] = float("nan")  # the first element of every chunk after the first
    logits[0, edges[1] - 1] = 9.0  # last element of chunk 0
    logits[1, edges[2] + 1] = 9.0  # just after a NaN at a chunk's start
    logits[2, edges[1] - 1] = 9.0
    logits[2, edges[c - 1] + 3] = 9.0  # tie across chunks: the lower index
    logits[3, v - 1] = 9.0  # the very last element
    logits[4, 0] = 9.0
    logits[5, edges[c // 2] - 1] = 9.0
    want = [edges[1] - 1, edges[2] + 1, edges[1] - 1, v - 1, 0, edges[c // 2] - 1]
    assert torch.equal(torch.argmax(logits.float().nan_to_num(-1e9), -1).cpu(), torch.tensor(want))
    st = make_state(b, device, 0.0, 0, 1.0)
    st.temperature[1::2] = 0.5
    st.top_k[1::2] = 1
    for launch_no in range(launches):
        out = torch.full((b,), -7, dtype=torch.int32, device=device)
        sample_tokens(logits, st, out)
        assert out.tolist() == want, launch_no
        assert int(st.counters.count_nonzero()) == 0
    assert st.offsets.tolist() == [launches] * b


def check_top_k_1_keeps_only_the_maximum(gen, device, *, b: int = 16, v: int = 152064) -> None:
    """top_k = 1 keeps the maximum value; bf16 ties at the maximum are all kept (HF's mask rule)."""
    logits = torch.randn(b, v, generator=gen, device=device).to(torch.bfloat16)
    out = torch.full((b,), -7, dtype=torch.int32, device=device)
    sample_tokens(logits, make_state(b, device, 0.8, 1, 1.0), out)
    picked = logits.gather(1, out.long()[:, None])[:, 0]
    assert torch.equal(picked, logits.max(-1).values)


def check_samples_lie_in_reference_set(temperature: float, top_k: int, top_p: float, gen, device, *,
                                       b: int = 64, v: int = 152064, launches: int = 3) -> None:
    logits = (3 * torch.randn(b, v, generator=gen, device=device)).to(torch.bfloat16)
    st = make_state(b, device, temperature, top_k, top_p)
    for _ in range(launches):
        out = torch.full((b,), -7, dtype=torch.int32, device=device)
        sample_tokens(logits, st, out)
        for r in range(b):
            mask = R.sampling_mask(logits[r], temperature, top_k, min(1.0, top_p + TOP_P_SLACK))
            assert 0 <= int(out[r]) < v and mask[out[r]], \
                f"row {r}: token {int(out[r])} outside the top-k/top-p set"
    assert st.offsets.tolist() == [launches] * b


def check_distribution_matches_reference(temperature: float, top_k: int, top_p: float, gen, device, *,
                                         b: int = 20000, v: int = 64) -> None:
    """`b` rows with the same logits and different seeds: chi-square against the exact distribution.

    Tokens expected fewer than 5 times are pooled into one bin (the chi-square approximation needs
    expected counts >= 5; a single draw of a token expected 0.2 times would add 3.2 on its own). The
    bound, dof + 6 sqrt(2 dof) + 10, is exceeded by a sound sampler with probability 1e-5 at 1 dof,
    4e-7 at 19, 8e-8 at 63 (exact chi-square tails; the +10 is for the skew at small dof). The
    kernel's fp32 probabilities (relative error ~1e-5, see TOP_P_SLACK) and its 24-bit uniform draw
    shift the expected counts by < 0.01 in total at 20000 draws: no visible bias."""
    row = (1.5 * torch.randn(v, generator=gen, device=device)).to(torch.bfloat16)
    logits = row.expand(b, v).contiguous()
    out = torch.full((b,), -7, dtype=torch.int32, device=device)
    sample_tokens(logits, make_state(b, device, temperature, top_k, top_p), out)
    probs = R.sampling_probs(row, temperature, top_k, top_p).cpu()
    assert bool(((out >= 0) & (out < v)).all()), "a row's token is out of range (unwritten?)"
    counts = torch.bincount(out.long().cpu(), minlength=v).double()
    assert counts[probs == 0].sum() == 0, "sampled a token the reference excludes"
    keep = probs > 0
    expected, observed = probs[keep] * b, counts[keep]
    rare = expected < 5
    if rare.any():
        expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
        observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = expected.numel() - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, f"chi2 {chi2:.1f} with {dof} dof"


def check_seed_offset_reproduce(gen, device, *, b: int = 32, v: int = 5000) -> tuple:
    """The same (seed, offset) gives the same tokens. Returns (logits, state, out) for more launches."""
    logits = torch.zeros(b, v, dtype=torch.bfloat16, device=device)  # uniform: any repeat is suspicious
    logits += torch.randn(b, v, generator=gen, device=device).to(torch.bfloat16) * 0.01
    st = make_state(b, device, 1.0, 0, 1.0)
    out1 = torch.full((b,), -7, dtype=torch.int32, device=device)
    sample_tokens(logits, st, out1)
    st.offsets.zero_()
    out2 = torch.full_like(out1, -7)
    sample_tokens(logits, st, out2)
    assert torch.equal(out1, out2), "same (seed, offset) must give the same tokens"
    assert bool(((out1 >= 0) & (out1 < v)).all())
    out3 = torch.full_like(out1, -7)
    sample_tokens(logits, st, out3)  # offset 1: fresh draws (near-uniform over v: few repeats)
    assert int((out3 == out1).sum()) <= max(3, b // 8), "a new offset repeated the draws"
    return logits, st, out1
