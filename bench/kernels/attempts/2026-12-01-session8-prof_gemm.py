"""Launch the INT4 GEMM three times per case (qkv shape 4608 x 3584, g128 symmetric; M = 16, then
M = 128) for ncu: `ncu -k regex:gemm_int4 --launch-skip 2 --launch-count 2 python3 THIS` profiles
the third M = 16 launch and the first M = 128 one (session 8's run of the wgmma attempt:
bench/kernels/results/gemm-wgmma-attempt-2026-12-01/). Run from the repository root with every
package's src on PYTHONPATH."""

import sys

import torch

sys.path.insert(0, "packages/nanoqwen-kernels/tests")  # int4_testkit
from int4_testkit import random_int4  # noqa: E402
from nanoqwen_kernels import gemm  # noqa: E402

dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(1)
n, k = 4608, 3584
w = random_int4(n, k, 128, True, gen, dev)
for m in (16, 128):
    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    plan = gemm.plan_gemm(n, k, m, 128, dev)
    ws = gemm.allocate_workspace([plan], dev)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        gemm.gemm_int4(x, w, out, None, ws, plan)
    torch.cuda.synchronize()
print("prof done")
