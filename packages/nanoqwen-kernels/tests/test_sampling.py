"""GPU: sampling. Greedy equals torch.argmax (lowest index among ties); every sampled token lies in
the reference top-k/top-p set; the empirical distribution over many seeds matches the reference
(chi-square); offsets advance on every launch, also in a replayed CUDA graph, which draws fresh
tokens; a (seed, offset) pair reproduces its token."""

from __future__ import annotations

import pytest
import torch
from nanoqwen_kernels import reference as R

pytestmark = pytest.mark.gpu

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


def make_state(b, device, temperature, top_k, top_p, seed0=1234):
    from nanoqwen_kernels.sampling import SamplingState

    st = SamplingState.allocate(b, device)
    st.temperature.fill_(temperature)
    st.top_k.fill_(top_k)
    st.top_p.fill_(top_p)
    st.seeds.copy_(torch.arange(seed0, seed0 + b, device=device) * 7919)
    return st


@pytest.mark.parametrize("b,v", [(1, 152064), (5, 151936), (3, 1000)])
def test_greedy_is_argmax_with_ties(b, v, gen, device):
    from nanoqwen_kernels.sampling import sample_tokens

    logits = torch.randn(b, v, generator=gen, device=device).to(torch.bfloat16)
    logits[:, v // 3] = 9.0
    logits[:, v // 2] = 9.0  # tie: the lower index wins
    logits[0, 5] = float("nan")  # NaN never wins
    out = torch.full((b,), -7, dtype=torch.int32, device=device)
    st = make_state(b, device, 0.0, 0, 1.0)
    sample_tokens(logits, st, out)
    assert out.tolist() == [v // 3] * b
    assert st.offsets.tolist() == [1] * b


@pytest.mark.parametrize("v", [8 * 1024 * 3 + 8, 152064])
def test_greedy_across_chunks(v, gen, device):
    """A row read by several blocks (sampling.chunks_per_row): the maximum at either end of a chunk, a
    tie across two chunks (the lower index wins), NaN in every chunk, and rows whose maximum is in the
    first or the last chunk; greedy rows beside sampled ones (top_k = 1: the maximum too, but from the
    last block's full sampling path). The arrival counters are back at 0 after every launch."""
    from nanoqwen_kernels.sampling import chunks_per_row, sample_tokens

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
    for launch_no in range(3):
        out = torch.full((b,), -7, dtype=torch.int32, device=device)
        sample_tokens(logits, st, out)
        assert out.tolist() == want, launch_no
        assert int(st.counters.count_nonzero()) == 0
    assert st.offsets.tolist() == [3] * b


def test_top_k_1_keeps_only_the_maximum(gen, device):
    """top_k = 1 keeps the maximum value; bf16 ties at the maximum are all kept (HF's mask rule)."""
    from nanoqwen_kernels.sampling import sample_tokens

    logits = torch.randn(16, 152064, generator=gen, device=device).to(torch.bfloat16)
    out = torch.empty(16, dtype=torch.int32, device=device)
    sample_tokens(logits, make_state(16, device, 0.8, 1, 1.0), out)
    picked = logits.gather(1, out.long()[:, None])[:, 0]
    assert torch.equal(picked, logits.max(-1).values)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 50, 1.0), (0.7, 0, 0.9), (1.3, 40, 0.8), (0.6, 0, 0.5)]
)
def test_samples_lie_in_reference_set(temperature, top_k, top_p, gen, device):
    from nanoqwen_kernels.sampling import sample_tokens

    b, v = 64, 152064
    logits = (3 * torch.randn(b, v, generator=gen, device=device)).to(torch.bfloat16)
    out = torch.empty(b, dtype=torch.int32, device=device)
    st = make_state(b, device, temperature, top_k, top_p)
    for _ in range(3):
        sample_tokens(logits, st, out)
        for r in range(b):
            mask = R.sampling_mask(logits[r], temperature, top_k, min(1.0, top_p + TOP_P_SLACK))
            assert mask[out[r]], f"row {r}: token {int(out[r])} outside the top-k/top-p set"
    assert st.offsets.tolist() == [3] * b


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 20, 1.0), (1.0, 0, 0.7), (1.5, 30, 0.9)]
)
def test_distribution_matches_reference(temperature, top_k, top_p, gen, device):
    """20000 rows with the same logits and different seeds: chi-square against the exact distribution.

    Tokens expected fewer than 5 times are pooled into one bin (the chi-square approximation needs
    expected counts >= 5; a single draw of a token expected 0.2 times would add 3.2 on its own). The
    bound, dof + 6 sqrt(2 dof) + 10, is exceeded by a sound sampler with probability 1e-5 at 1 dof,
    4e-7 at 19, 8e-8 at 63 (exact chi-square tails; the +10 is for the skew at small dof). The
    kernel's fp32 probabilities (relative error ~1e-5, see TOP_P_SLACK) and its 24-bit uniform draw
    shift the expected counts by < 0.01 in total: no visible bias at 20000 draws."""
    from nanoqwen_kernels.sampling import sample_tokens

    b, v = 20000, 64
    row = (1.5 * torch.randn(v, generator=gen, device=device)).to(torch.bfloat16)
    logits = row.expand(b, v).contiguous()
    out = torch.empty(b, dtype=torch.int32, device=device)
    sample_tokens(logits, make_state(b, device, temperature, top_k, top_p), out)
    probs = R.sampling_probs(row, temperature, top_k, top_p).cpu()
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


def test_seed_offset_reproduce_and_graph_replay_draws_fresh(gen, device):
    from nanoqwen_kernels.launch import warm_up
    from nanoqwen_kernels.sampling import sample_tokens

    b, v = 32, 5000
    logits = torch.zeros(b, v, dtype=torch.bfloat16, device=device)  # uniform: any repeat is suspicious
    logits += torch.randn(b, v, generator=gen, device=device).to(torch.bfloat16) * 0.01
    st = make_state(b, device, 1.0, 0, 1.0)
    out1 = torch.empty(b, dtype=torch.int32, device=device)
    sample_tokens(logits, st, out1)
    st.offsets.zero_()
    out2 = torch.empty_like(out1)
    sample_tokens(logits, st, out2)
    assert torch.equal(out1, out2), "same (seed, offset) must give the same tokens"

    warm_up(["sampling"], device)
    out = torch.empty_like(out1)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            sample_tokens(logits, st, out)
    torch.cuda.current_stream().wait_stream(stream)
    st.offsets.fill_(10)
    draws = []
    for _ in range(3):
        graph.replay()
        draws.append(out.clone())
    assert st.offsets.tolist() == [13] * b
    same = sum(int((draws[i] == draws[i + 1]).sum()) for i in range(2))
    # near-uniform over 5000 tokens: two fresh draws agree with probability ~1/5000, so 64 pairs give
    # 0.013 expected repeats and 4 or more happen with probability ~1e-9; a replay that reused its
    # random numbers would repeat all 64
    assert same <= 3, f"replayed graph repeated {same} of {2 * b} draws"
