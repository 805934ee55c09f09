"""Launch the INT4 GEMM of one 7B shape three times per M, for ncu (g128 symmetric weights, the
planner's plan):

    ncu --clock-control none --section SourceCounters --section WarpStateStats -k regex:gemm_int4 \
        --launch-skip 2 --launch-count 1 -f -o REPORT python3 bench/kernels/prof_gemm.py gate_up 64

profiles the third launch of the first M given. Run from the repository root with every package's src
on PYTHONPATH. `qkv 16 128` makes the launches session 8 profiled on its wgmma attempt."""

import sys

import torch

sys.path[:0] = ["packages/nanoqwen-kernels/tests", "bench/kernels"]  # int4_testkit, bench_gemm
from bench_gemm import SHAPES as _SHAPES  # noqa: E402
from int4_testkit import random_int4  # noqa: E402
from nanoqwen_kernels import gemm  # noqa: E402

SHAPES = {name: (n, k) for name, n, k in _SHAPES}

dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(1)
n, k = SHAPES[sys.argv[1]]
w = random_int4(n, k, 128, True, gen, dev)
for m in (int(a) for a in sys.argv[2:]):
    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    plan = gemm.plan_gemm(n, k, m, 128, dev)
    ws = gemm.allocate_workspace([plan], dev)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        gemm.gemm_int4(x, w, out, None, ws, plan)
    torch.cuda.synchronize()
    print(sys.argv[1], m, plan)
