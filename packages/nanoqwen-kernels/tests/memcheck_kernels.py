"""A reduced run of every kernel family on small odd shapes, for compute-sanitizer memcheck.

    compute-sanitizer --tool memcheck --error-exitcode 3 python memcheck_kernels.py

(`test_memcheck.py` runs that, through the `compute_sanitizer` fixture of conftest.py.) Each launch is
also checked against its reference, so the run proves the kernels touch only their own memory on the
paths the full tests exercise: GEMV (all group sizes, sym/asym, bf16 and fp16 scales, M = 1/5/8,
split-K forced and not, SiLU input), dequantize, the layer ops with a padding slot, the sampler
(greedy, top-k, top-p), and the o projection's attention merge prologue after split decode attention
(head dims 128 and 64, K split and not, a context-0 slot; attention_merge_testkit.py).
Exits 0 when all pass.
"""

from __future__ import annotations

import torch
from nanoqwen_kernels import gemv, layer_ops, sampling
from nanoqwen_kernels import reference as R


def main() -> int:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(5)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n, k = 40, 640
    cases = [(gs, sym, sdt) for gs in (32, 64, 128) for sym in (True, False)
             for sdt in (torch.bfloat16, torch.float16)]  # fp16 scales: the -f16s layout, zero points 0..16
    for gs, sym, sdt in cases:
        words = torch.randint(0, 256, (n * k // 2,), generator=g, device=dev, dtype=torch.uint8)
        scales = (0.02 * torch.rand(n, k // gs, generator=g, device=dev) + 0.01).to(sdt)
        zmax = 17 if sdt == torch.float16 else 16
        zeros = (
            None
            if sym
            else torch.randint(0, zmax, (n, k // gs), generator=g, device=dev, dtype=torch.uint8)
        )
        w = gemv.Int4Weight(
            words.view(torch.int32).reshape(n // 8, k // 128, 32, 4), scales, zeros, n, k, gs
        )
        dense = R.dequantize_int4(w.qweight, w.scales, w.zeros, gs)
        for m in (1, 5, 8):
            for target in (3, 10_000):
                plan = gemv.plan_shape(n, k, sms, target)
                ws = gemv.GemvWorkspace.allocate([plan], dev)
                x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
                bias = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
                gemv.gemv_int4(x, w, out, bias, ws, plan)
                R.assert_close(out, R.linear(x, dense, bias), f"gemv g{gs} sym={sym} {sdt} M={m}")
        gu = torch.randn(3, 2 * k, generator=g, device=dev).to(torch.bfloat16)
        out = torch.empty(3, n, dtype=torch.bfloat16, device=dev)
        ws = gemv.GemvWorkspace.allocate([gemv.plan_shape(n, k, sms)], dev)
        gemv.gemv_int4(gu, w, out, None, ws, silu_mul_input=True)
        R.assert_close(out, R.linear(R.silu_mul(gu).to(torch.bfloat16), dense), "gemv silu")
        deq = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
        gemv.dequantize_int4(w, deq)
        assert torch.equal(deq, dense.to(torch.bfloat16))

    t, h = 3, 1000
    x = torch.randn(t, h, generator=g, device=dev).to(torch.bfloat16)
    res = torch.randn(t, h, generator=g, device=dev).to(torch.bfloat16)
    wn = torch.randn(h, generator=g, device=dev).to(torch.bfloat16)
    out = torch.empty_like(x)
    layer_ops.rms_norm(x, wn, out, 1e-6)
    R.assert_close(out, R.rms_norm(x, wn, 1e-6))
    ref_out, ref_res = R.fused_add_rms_norm(x, res, wn, 1e-6)
    layer_ops.fused_add_rms_norm(x, res, wn, out, 1e-6)
    R.assert_close(out, ref_out)
    gu = torch.randn(t, 2 * 40, generator=g, device=dev).to(torch.bfloat16)
    act = torch.empty(t, 40, dtype=torch.bfloat16, device=dev)
    layer_ops.silu_mul(gu, act)
    R.assert_close(act, R.silu_mul(gu))
    table = torch.randn(50, 16, generator=g, device=dev).to(torch.bfloat16)
    ids = torch.tensor([0, 49, 50], dtype=torch.int32, device=dev)
    emb = torch.empty(3, 16, dtype=torch.bfloat16, device=dev)
    layer_ops.embedding_gather(ids, table, emb)
    assert torch.equal(emb[:2], table[[0, 49]]) and torch.isnan(emb[2]).all()
    shape = layer_ops.AttentionShape(4, 2, 32)
    qkv = torch.randn(5, shape.qkv_width, generator=g, device=dev).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 7, 300, 9], dtype=torch.int32, device=dev)
    slots = torch.tensor([0, -1, 5, 11, 15], dtype=torch.int32, device=dev)
    inv = layer_ops.rope_inv_freq(32, 10000.0, dev)
    kc = torch.zeros(4, 2, 4, 32, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    q = torch.empty(5, 4, 32, dtype=torch.bfloat16, device=dev)
    layer_ops.qkv_rope_kv_write(qkv, shape, pos, slots, inv, q, kc, vc, qkv[0].clone())
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    R.assert_close(q, R.qkv_rope_kv_write(qkv, 4, 2, 32, pos, slots, inv, kr, vr, qkv[0].clone()))

    logits = torch.randn(3, 1000, generator=g, device=dev).to(torch.bfloat16)
    st = sampling.SamplingState.allocate(3, dev)
    st.temperature.copy_(torch.tensor([0.0, 0.8, 1.2]))
    st.top_k.copy_(torch.tensor([0, 10, 0], dtype=torch.int32))
    st.top_p.copy_(torch.tensor([1.0, 0.9, 0.6]))
    tok = torch.empty(3, dtype=torch.int32, device=dev)
    sampling.sample_tokens(logits, st, tok)
    assert int(tok[0]) == int(logits[0].float().argmax())
    slack = 1e-3  # on top_p: the kernel's fp32 mass sums (test_sampling.py TOP_P_SLACK derives it)
    assert (
        R.sampling_mask(logits[1], 0.8, 10, 0.9 + slack)[tok[1]]
        and R.sampling_mask(logits[2], 1.2, 0, 0.6 + slack)[tok[2]]
    )
    from attention_merge_testkit import check_merge_prologue_equals_combine  # beside this script

    check_merge_prologue_equals_combine((4, 2, 128), [130, 1, 300, 0], dev, max_context_len=512, runs=1)
    check_merge_prologue_equals_combine((6, 2, 64), [200, 64], dev, max_context_len=512, gemv_split="unsplit",
                                        group_size=64, symmetric=True, runs=1)
    torch.cuda.synchronize()
    print("memcheck_kernels: all kernels ran and matched their references")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
