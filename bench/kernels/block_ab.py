"""The post-attention block kernel (nanoqwen_kernels.block) against the GEMV launches it replaces.

    python bench/kernels/block_ab.py --out DIR [--builds default,w16c4r2,...] [--layers 8]

At the Qwen2.5-Coder-7B geometry (o_proj 3584 -> 3584, gate_up 3584 -> 2 x 18944, down 18944 -> 3584, the
next layer's qkv 3584 -> 4608 with 28 / 4 heads of 128), INT4 g128 sym and asym, M = 1 and 2, this
measures in one process:
- the read bandwidth (nanoqwen_kernels.bench.read_bandwidth: 4 GiB, median of 30);
- "gemv": per layer, the engine's decode path at M <= 8 before this kernel: o_proj GEMV with the residual
  epilogue, gate_up GEMV with the norm prologue, down GEMV with the SiLU input and the residual epilogue;
  "gemv+qkv": the same and the next layer's qkv GEMV (norm prologue, RoPE / paged K/V epilogue);
  "gemv:i8", "gemv+qkv:i8": the same with the GEMVs' int8 build (gemv.register_int8_mma);
- "block[:BUILD]" / "block+qkv[:BUILD]": per layer, one `post_attention_block` launch without / with the
  next layer's qkv, for each build in --builds (BUILDS below: warps per CTA, tile-columns per ring
  slot, ring slots per warp).
Each is captured as one CUDA graph over `--layers` layers with their own weights (8 x 117 MB: every
replay reads cold weights, as a decode step does), median of 15 replays, divided by the layers.
Bytes per layer: the weights' packed words, scales and zeros (Int4Weight.nbytes). Before any timing each
build's outputs on layer 0 are checked against the GEMV path's (relative L2 error of the residual update,
of gate_up and of q < 1%: a build that computes something else stops the run).
Writes DIR/block_ab.json and DIR/block_ab.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

H, INTER, KQ = 3584, 18944, 3584
HQ, HKV, D = 28, 4, 128
EPS = 1e-6
# name -> (warps per CTA, tile-columns per slot, slots per warp[, the int8 loop]) (block.BlockBuild);
# "default" is the header's build, "i8" block.INT8_MMA_BUILD (the int8 tensor-core chunk step; 2 slots:
# with 3 the 7B's shared memory is 384 bytes over the limit)
BUILDS = {
    "default": (16, 3, 3),
    "w16c4r2": (16, 4, 2),
    "w16c2r4": (16, 2, 4),
    "w12c4r3": (12, 4, 3),
    "w20c2r3": (20, 2, 3),
    "w20c3r2": (20, 3, 2),
    "w8c4r4": (8, 4, 4),
    "i8": (16, 3, 2, True),
    "i8c4r2": (16, 4, 2, True),
    "i8w20c3r2": (20, 3, 2, True),
}


class Step:
    """One decode step's buffers at M rows and the layers' weights (o_proj, gate_up, down, next qkv)."""

    def __init__(self, layers, m, gen):
        import torch
        from nanoqwen_kernels import gemv, layer_ops

        bf = dict(dtype=torch.bfloat16, device="cuda")
        self.layers, self.m = layers, m
        self.shape = layer_ops.AttentionShape(HQ, HKV, D)
        self.attn = torch.randn(m, KQ, generator=gen, device="cuda").to(torch.bfloat16)
        self.resid0 = torch.randn(m, H, generator=gen, device="cuda").to(torch.bfloat16)
        self.resid = self.resid0.clone()
        self.gate_up = torch.empty(m, 2 * INTER, **bf)
        self.stats = torch.empty(gemv.norm_stats_shape(m, H), dtype=torch.float32, device="cuda")
        self.norm_w = (1 + 0.1 * torch.randn(H, generator=gen, device="cuda")).to(torch.bfloat16)
        self.in_norm_w = (1 + 0.1 * torch.randn(H, generator=gen, device="cuda")).to(torch.bfloat16)
        self.bias = torch.randn(self.shape.qkv_width, generator=gen, device="cuda").to(torch.bfloat16)
        self.positions = torch.randint(0, 4096, (m,), generator=gen, device="cuda", dtype=torch.int32)
        self.slots = torch.arange(m, dtype=torch.int32, device="cuda") * 16 + 16
        self.inv_freq = layer_ops.rope_inv_freq(D, 1_000_000.0, "cuda")
        self.q = torch.empty(m, HQ, D, **bf)
        self.kc = torch.zeros(m + 2, HKV, 16, D, **bf)
        self.vc = torch.zeros_like(self.kc)

    def reset(self):
        self.resid.copy_(self.resid0)
        self.gate_up.fill_(float("nan"))
        self.q.fill_(float("nan"))


def run(out_dir: Path, builds: list[str], layers: int) -> dict:
    import torch
    from bench_kernels import random_weight
    from nanoqwen_kernels import block, gemv
    from nanoqwen_kernels.bench import read_bandwidth, time_graph

    dev = torch.device("cuda")
    read_bps = read_bandwidth(dev)["bytes_per_s"]
    for name in builds:
        if name != "default":
            block.register_build(f"block_{name}", block.BlockBuild(*BUILDS[name]))
    gen = torch.Generator(device="cuda").manual_seed(0)
    g_plans = (gemv.plan_gemv(H, KQ, dev), gemv.plan_gemv(2 * INTER, H, dev),
               gemv.plan_gemv(H, INTER, dev, silu_input=True), gemv.plan_gemv(HQ * D + 2 * HKV * D, H, dev))
    g_ws = gemv.GemvWorkspace.allocate(g_plans, dev)
    rows = []
    for symmetric in (False, True):
        kind = "sym" if symmetric else "asym"
        shapes = ((H, KQ), (2 * INTER, H), (H, INTER), ((HQ + 2 * HKV) * D, H))
        weights = [tuple(random_weight(n, k, gen, symmetric) for n, k in shapes) for _ in range(layers)]
        nbytes3 = sum(w.nbytes() for w in weights[0][:3])
        nbytes4 = nbytes3 + weights[0][3].nbytes()
        for m in (1, 2):
            st = Step(weights, m, gen)

            def gemv_layer(i, st=st, qkv=False, family=gemv.FAMILY):
                w_o, w_gu, w_d, w_q = st.layers[i % layers]
                gemv.gemv_int4(st.attn, w_o, None, None, g_ws, g_plans[0], family=family,
                               residual=gemv.ResidualEpilogue(st.resid, st.stats))
                gemv.gemv_int4(st.resid, w_gu, st.gate_up, None, g_ws, g_plans[1], family=family,
                               norm=gemv.NormPrologue(st.norm_w, st.stats, EPS))
                gemv.gemv_int4(st.gate_up, w_d, None, None, g_ws, g_plans[2], silu_mul_input=True,
                               family=family, residual=gemv.ResidualEpilogue(st.resid, st.stats))
                if qkv:
                    gemv.gemv_int4_qkv_rope(st.resid, w_q, st.bias, st.shape, st.positions, st.slots,
                                            st.inv_freq, st.q, st.kc, st.vc, g_ws, g_plans[3], family,
                                            norm=gemv.NormPrologue(st.in_norm_w, st.stats, EPS))

            st.reset()
            gemv_layer(0, qkv=True)
            want = (st.resid.clone(), st.gate_up.clone(), st.q.clone())
            # the GEMV path with the bf16 loop ("gemv", every row's baseline) and, beside it, with the int8
            # build (gemv.register_int8_mma: what an int8 block build replaces)
            for family, tag in ((gemv.FAMILY, ""), (gemv.register_int8_mma(), ":i8")):
                for qkv, nbytes in ((False, nbytes3), (True, nbytes4)):
                    t = time_graph(lambda i, qkv=qkv, family=family: gemv_layer(i, qkv=qkv, family=family),
                                   reps=layers)
                    path = ("gemv+qkv" if qkv else "gemv") + tag
                    rows.append({"path": path, "kind": kind, "m": m, "us": t * 1e6,
                                 "frac_read": nbytes / t / read_bps})
                    print(f"{path:18s} {kind:4s} M={m} {t * 1e6:8.2f} us/layer "
                          f"{rows[-1]['frac_read']:6.1%}", flush=True)
            for name in builds:
                family = "block" if name == "default" else f"block_{name}"
                for qkv, nbytes in ((False, nbytes3), (True, nbytes4)):
                    plan = block.plan_post_attention(H, INTER, KQ, dev, family=family,
                                                     qkv_dim=st.shape.qkv_width if qkv else None)
                    b_ws = block.BlockWorkspace.allocate(plan, dev)

                    def block_layer(i, st=st, plan=plan, b_ws=b_ws, qkv=qkv):
                        w_o, w_gu, w_d, w_q = st.layers[i % layers]
                        nxt = block.NextQkv(w_q, st.bias, st.in_norm_w, st.shape, st.positions, st.slots,
                                            st.inv_freq, st.q, st.kc, st.vc) if qkv else None
                        block.post_attention_block(st.attn, w_o, st.norm_w, EPS, w_gu, w_d, st.resid,
                                                   st.gate_up, st.stats, b_ws, plan, next_qkv=nxt)

                    st.reset()
                    block_layer(0)
                    torch.cuda.synchronize()
                    err = {"resid": float((st.resid.float() - want[0].float()).norm()
                                          / (want[0].float() - st.resid0.float()).norm()),
                           "gate_up": float((st.gate_up.float() - want[1].float()).norm()
                                            / want[1].float().norm())}
                    if qkv:
                        err["q"] = float((st.q.float() - want[2].float()).norm() / want[2].float().norm())
                    if not all(e < 1e-2 for e in err.values()):
                        raise SystemExit(f"block {name} qkv={qkv} {kind} M={m}: wrong outputs, relative "
                                         f"errors {err}")
                    t = time_graph(block_layer, reps=layers)
                    path = f"block{'+qkv' if qkv else ''}:{name}"
                    rows.append({"path": path, "build": BUILDS[name], "kind": kind, "m": m,
                                 "us": t * 1e6, "frac_read": nbytes / t / read_bps, "errors": err})
                    print(f"{path:18s} {kind:4s} M={m} {t * 1e6:8.2f} us/layer {rows[-1]['frac_read']:6.1%}",
                          flush=True)
        weights = st = None
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "read_bytes_per_s": read_bps, "layers": layers,
              "bytes_per_layer": nbytes3, "bytes_per_layer_with_qkv": nbytes4, "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "block_ab.json").write_text(json.dumps(result, indent=1))
    (out_dir / "block_ab.md").write_text(report(result))
    return result


def report(r: dict) -> str:
    lines = [f"# Post-attention block: one launch against the GEMVs ({r['device']})\n",
             f"Read bandwidth {r['read_bytes_per_s'] / 1e9:.0f} GB/s; {r['bytes_per_layer'] / 1e6:.1f} MB of "
             f"weights per layer ({r['bytes_per_layer_with_qkv'] / 1e6:.1f} MB with the next qkv); "
             f"{r['layers']} layers per graph.\n",
             "| path | kind | M | us / layer | of read BW | vs the GEMVs |", "|---|---|---|---|---|---|"]
    base = {(x["path"], x["kind"], x["m"]): x["us"] for x in r["rows"] if x["path"] in ("gemv", "gemv+qkv")}
    for x in r["rows"]:
        ref = base[("gemv+qkv" if "qkv" in x["path"] else "gemv", x["kind"], x["m"])]
        lines.append(f"| {x['path']} | {x['kind']} | {x['m']} | {x['us']:.2f} | {x['frac_read']:.1%} | "
                     f"{x['us'] / ref:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--builds", default="default")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    builds = args.builds.split(",")
    unknown = [b for b in builds if b not in BUILDS]
    if unknown:
        raise SystemExit(f"unknown builds {unknown}; known: {sorted(BUILDS)}")
    run(args.out, builds, args.layers)


if __name__ == "__main__":
    main()
