"""A reduced run of the post-attention block kernel for compute-sanitizer (memcheck, synccheck,
initcheck): the 0.5B geometry and a small odd one, M = 1 and 2, without and with the next layer's qkv
op, each launch's residual compared with the three GEMVs' (relative L2 error of the update < 1%: the
tight bounds are test_block.py's). `test_block.py::test_compute_sanitizer_clean` runs it.

    compute-sanitizer --tool memcheck python sanitize_block.py

Prints "sanitize_block: OK" at its end."""

from __future__ import annotations

import torch
from nanoqwen_kernels import block, gemv, layer_ops


def _weight(n, k, g, dev):
    words = torch.randint(0, 256, (n * k // 2,), generator=g, device=dev, dtype=torch.uint8)
    scales = ((0.5 + torch.rand(n, k // 128, generator=g, device=dev)) / (4.6 * k**0.5)).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // 128), generator=g, device=dev, dtype=torch.uint8)
    return gemv.Int4Weight(words.view(torch.int32).reshape(n // 8, k // 128, 32, 4), scales, zeros, n, k, 128)


def main() -> int:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(7)
    eps = 1e-6
    for h, inter, (hq, hkv, d) in ((896, 4864, (14, 2, 64)), (640, 1152, (6, 2, 64))):
        kq = hq * d
        w_o, w_gu, w_d = _weight(h, kq, g, dev), _weight(2 * inter, h, g, dev), _weight(h, inter, g, dev)
        shape = layer_ops.AttentionShape(hq, hkv, d)
        w_q = _weight(shape.qkv_width, h, g, dev)
        norm_w = (1 + 0.1 * torch.randn(h, generator=g, device=dev)).to(torch.bfloat16)
        for m in (1, 2):
            attn = torch.randn(m, kq, generator=g, device=dev).to(torch.bfloat16)
            resid0 = torch.randn(m, h, generator=g, device=dev).to(torch.bfloat16)
            # the GEMVs' residual: the reference
            plans = (gemv.plan_gemv(h, kq, dev), gemv.plan_gemv(2 * inter, h, dev),
                     gemv.plan_gemv(h, inter, dev, silu_input=True))
            gws = gemv.GemvWorkspace.allocate(plans, dev)
            want = resid0.clone()
            stats = torch.zeros(gemv.norm_stats_shape(m, h), dtype=torch.float32, device=dev)
            gu = torch.zeros(m, 2 * inter, dtype=torch.bfloat16, device=dev)
            gemv.gemv_int4(attn, w_o, None, None, gws, plans[0],
                           residual=gemv.ResidualEpilogue(want, stats))
            gemv.gemv_int4(want, w_gu, gu, None, gws, plans[1], norm=gemv.NormPrologue(norm_w, stats, eps))
            gemv.gemv_int4(gu, w_d, None, None, gws, plans[2], silu_mul_input=True,
                           residual=gemv.ResidualEpilogue(want, stats))
            for with_qkv in (False, True):
                qkv_dim = shape.qkv_width if with_qkv else None
                plan = block.plan_post_attention(h, inter, kq, dev, qkv_dim=qkv_dim)
                ws = block.BlockWorkspace.allocate(plan, dev)  # scratch left unwritten: initcheck's case
                nxt = None
                if with_qkv:
                    kc = torch.zeros(m + 2, hkv, 16, d, dtype=torch.bfloat16, device=dev)
                    bias = torch.randn(shape.qkv_width, generator=g, device=dev).to(torch.bfloat16)
                    rows = torch.arange(m, dtype=torch.int32, device=dev)
                    q_out = torch.zeros(m, hq, d, dtype=torch.bfloat16, device=dev)
                    nxt = block.NextQkv(w_q, bias, norm_w, shape, rows + 5, rows * 16 + 3,
                                        layer_ops.rope_inv_freq(d, 1e6, dev), q_out, kc, kc.clone())
                resid = resid0.clone()
                out_gu = torch.zeros(m, 2 * inter, dtype=torch.bfloat16, device=dev)
                out_stats = torch.zeros(gemv.norm_stats_shape(m, h), dtype=torch.float32, device=dev)
                block.post_attention_block(attn, w_o, norm_w, eps, w_gu, w_d, resid, out_gu, out_stats, ws,
                                           plan, next_qkv=nxt)
                torch.cuda.synchronize()
                err = float((resid.float() - want.float()).norm() / (want.float() - resid0.float()).norm())
                assert err < 1e-2, f"h={h} M={m} qkv={with_qkv}: residual update off by {err:.3g}"
                assert int(ws.counters.abs().sum()) == 0
                if nxt is not None:
                    assert not bool(nxt.q_out.isnan().any()) and bool(nxt.q_out.abs().sum() > 0)
    print("sanitize_block: OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
