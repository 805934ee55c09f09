"""Session 26 diagnostic (GPU): where the int8 GEMV build's output differs from its reference. For the
case test_gemv_int8_mma.py failed on (1000 x 1152, M = 8, g128 sym, 9 K splits, wide-range x), and a few
seeds: the kernel's output against (a) the fp32 reference on the GPU (as the test computes it), (b) an
fp64 reference on the CPU, (c) the bf16 build's output; errors in half-ulps of bf16 at the reference."""

import sys

import torch

sys.path.insert(0, "packages/nanoqwen-kernels/tests")
import int8_mma_testkit as kit  # noqa: E402
from int4_testkit import random_int4  # noqa: E402
from nanoqwen_kernels import gemv  # noqa: E402
from nanoqwen_kernels import reference as R  # noqa: E402
from nanoqwen_kernels.gemv import GemvPlan  # noqa: E402


def half_ulp(v: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(v.abs().clamp_min(1e-30)))
    return torch.pow(2.0, e - 8)


def main() -> None:
    dev = torch.device("cuda")
    n = torch.arange(-126, 120, device=dev).double()
    exact = torch.equal(torch.pow(2.0, n).cpu(), torch.pow(2.0, n.cpu()))
    print(f"torch.pow(2.0, n) on the GPU equals the CPU's (exact powers of two): {exact}", flush=True)
    for staged in (False, True):
        fam = gemv.register_int8_mma(staged=staged)
        for seed in range(4):
            gen = torch.Generator(device=dev).manual_seed(seed)
            n, k, m = 1000, 1152, 8
            w = random_int4(n, k, 128, True, gen, dev)
            x = kit.wide_range_x(m, k, gen, dev)
            bias = torch.randn(n, generator=gen, device=dev).to(torch.bfloat16)
            for plan in (GemvPlan(n, k, 9, 1), GemvPlan(n, k, 1, 9)):
                out = kit.run_plain(x, w, plan, kit.no_context, bias, seed=m, family=fam).float().cpu()
                ref_bf = kit.run_plain(x, w, plan, kit.no_context, bias, seed=m, family="gemv").float().cpu()
                xq = R.int8_planes_input(x)
                dense = R.dequantize_int4(w.qweight, w.scales, w.zeros, 128)
                gpu32 = R.linear(xq, dense, bias).cpu()
                cpu64 = (xq.double().cpu() @ dense.double().cpu().T + bias.double().cpu()).float()
                exact_x = (x.double().cpu() @ dense.double().cpu().T + bias.double().cpu()).float()
                hu = half_ulp(cpu64)
                err = (out - cpu64).abs()
                err_bf = (ref_bf - exact_x).abs()
                print("  per-row max |int8 - fp64|:", [f"{v:.1e}" for v in err.amax(dim=1).tolist()],
                      " bf16 build - fp64(x):", [f"{v:.1e}" for v in err_bf.amax(dim=1).tolist()])
                for name, a, b in (("int8 vs fp64(xq)", out, cpu64), ("gpu fp32 ref vs fp64", gpu32, cpu64),
                                   ("bf16 build vs fp64(x)", ref_bf, exact_x),
                                   ("xq vs x (fp64 refs)", cpu64, exact_x)):
                    r = (a - b).abs() / hu
                    print(f"{fam} seed {seed} splits {plan.splits}: {name:22s} max {r.max():7.2f} half-ulps, "
                          f"p99 {r.flatten().kthvalue(int(0.99 * r.numel())).values:5.2f}, "
                          f"max abs {(a - b).abs().max():.2e}", flush=True)


main()
