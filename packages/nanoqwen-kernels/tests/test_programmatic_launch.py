"""GPU: programmatic dependent launch in a captured graph (csrc/common.cuh's pdl_wait, launch.py).

A chain of dependent launches -- two INT4 linears (the GEMV at M = 1, the wgmma GEMM split along K at
M = 16 / 64), fused add + RMSNorm of the second one's output, and a third linear on the normed rows
(the mma.sync GEMM above 8 rows) -- is captured in one CUDA graph, every launch of it programmatic
(asserted through a spy on `cuda_driver.launch_ex`), and replayed on fresh inputs. Each replay must give
the bits the same launches give eagerly (plain launches) on that input: a kernel that read its input, or
a split-K counter, before its pdl_wait would read what the previous kernel had not yet written, which
with the overlap is the previous replay's value.
"""

from __future__ import annotations

import pytest
import torch
from int4_testkit import random_int4, same_bits
from nanoqwen_kernels import cuda_driver, gemm, gemv, launch, layer_ops

pytestmark = pytest.mark.gpu

N = K = 1024
EPS = 1e-6


@pytest.mark.parametrize("m", [1, 16, 64])
def test_captured_programmatic_chain_gives_the_eager_bits(m, gen, device, monkeypatch):
    bf16 = torch.bfloat16
    w1, w2, w3 = (random_int4(N, K, 128, False, gen, device) for _ in range(3))
    norm_w = (0.5 + torch.rand(N, generator=gen, device=device)).to(bf16)
    resid0 = torch.randn(m, N, generator=gen, device=device).to(bf16)
    inputs = [torch.randn(m, K, generator=gen, device=device).to(bf16) for _ in range(4)]
    x, resid = torch.empty_like(inputs[0]), torch.empty_like(resid0)
    y1, y2, normed, y3 = (torch.empty(m, N, dtype=bf16, device=device) for _ in range(4))

    if m <= gemv.MAX_M:
        plan = gemv.plan_gemv(N, K, device)
        ws = gemv.GemvWorkspace.allocate([plan], device)

        def linear(inp, w, out, last=False):
            gemv.gemv_int4(inp, w, out, workspace=ws, plan=plan)
    else:
        mc = gemm.m_class(m)
        split = gemm.GemmPlan.of(N, K, 128, mc // 8, mc, 2, kernel="wgmma")  # two K splits: counters
        plain = gemm.plan_gemm(N, K, m, 128, device)
        ws = gemm.allocate_workspace([split, plain], device)

        def linear(inp, w, out, last=False):
            gemm.gemm_int4(inp, w, out, workspace=ws, plan=plain if last else split)

    def chain():
        resid.copy_(resid0)  # a torch kernel in the chain: the next launch follows a plain one
        linear(x, w1, y1)
        linear(y1, w2, y2)
        layer_ops.fused_add_rms_norm(y2, resid, norm_w, normed, EPS)
        linear(normed, w3, y3, last=True)

    expected = []
    for inp in inputs:  # eager: plain launches
        x.copy_(inp)
        chain()
        expected.append((y3.clone(), resid.clone()))
    torch.cuda.synchronize(device)

    launches = []
    real_launch_ex = cuda_driver.launch_ex

    def spy(*args, **kwargs):
        launches.append(args[6] if len(args) > 6 else kwargs.get("programmatic", False))
        return real_launch_ex(*args, **kwargs)

    monkeypatch.setattr(launch, "PROGRAMMATIC", True)
    monkeypatch.setattr(cuda_driver, "launch_ex", spy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    assert launches == [True] * 4, f"the captured launches were not all programmatic: {launches}"

    for i in (3, 0, 2, 1):  # each replay after another input: stale values would show
        x.copy_(inputs[i])
        graph.replay()
        torch.cuda.synchronize(device)
        same_bits(y3, expected[i][0], f"M={m} replay of input {i}: y3")
        same_bits(resid, expected[i][1], f"M={m} replay of input {i}: residual")
