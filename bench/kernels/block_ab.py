"""The post-attention block kernel (nanoqwen_kernels.block) against the three GEMV launches it replaces.

    python bench/kernels/block_ab.py --out DIR [--builds default,w16c4r2,...] [--layers 8]

At the Qwen2.5-Coder-7B geometry (o_proj 3584 -> 3584, gate_up 3584 -> 2 x 18944, down 18944 -> 3584),
INT4 g128 sym and asym, M = 1 and 2, this measures in one process:
- the read bandwidth (nanoqwen_kernels.bench.read_bandwidth: 4 GiB, median of 30);
- "gemv": per layer, the engine's decode path at M <= 8 before this kernel: o_proj GEMV with the residual
  epilogue, gate_up GEMV with the norm prologue, down GEMV with the SiLU input and the residual epilogue;
- "block[:BUILD]": per layer, one `post_attention_block` launch of each build in --builds (BUILDS below:
  warps per CTA, tile-columns per ring slot, ring slots per warp).
Each is captured as one CUDA graph over `--layers` layers with their own weights (8 x 108 MB: every
replay reads cold weights, as a decode step does), median of 15 replays, divided by the layers.
Bytes per layer: the three weights' packed words, scales and zeros (Int4Weight.nbytes). Before any
timing each build's outputs on layer 0 are checked against the GEMV path's (relative L2 error of the
residual update and of gate_up < 1%: a build that computes something else stops the run).
Writes DIR/block_ab.json and DIR/block_ab.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

H, INTER, KQ = 3584, 18944, 3584
EPS = 1e-6
# name -> (warps per CTA, tile-columns per slot, slots per warp); "default" is the header's build
BUILDS = {
    "default": (16, 3, 3),
    "w16c4r2": (16, 4, 2),
    "w16c2r4": (16, 2, 4),
    "w12c4r3": (12, 4, 3),
    "w20c2r3": (20, 2, 3),
    "w20c3r2": (20, 3, 2),
    "w8c4r4": (8, 4, 4),
}


def _weight(n, k, symmetric, gen):
    import torch
    from nanoqwen_kernels.gemv import Int4Weight

    words = torch.randint(0, 256, (n * k // 2,), generator=gen, device="cuda", dtype=torch.uint8)
    qweight = words.view(torch.int32).reshape(n // 8, k // 128, 32, 4)
    scales = (0.5 + torch.rand(n, k // 128, generator=gen, device="cuda")) / (4.6 * k**0.5)
    scales = scales.to(torch.bfloat16)
    zeros = None if symmetric else torch.randint(0, 16, (n, k // 128), generator=gen, device="cuda",
                                                 dtype=torch.uint8)
    return Int4Weight(qweight, scales, zeros, n, k, 128)


def run(out_dir: Path, builds: list[str], layers: int) -> dict:
    import torch
    from nanoqwen_kernels import block, gemv
    from nanoqwen_kernels.bench import read_bandwidth, time_graph

    dev = torch.device("cuda")
    read_bps = read_bandwidth(dev)["bytes_per_s"]
    for name in builds:
        if name != "default":
            block.register_build(f"block_{name}", block.BlockBuild(*BUILDS[name]))
    gen = torch.Generator(device="cuda").manual_seed(0)
    g_plans = (gemv.plan_gemv(H, KQ, dev), gemv.plan_gemv(2 * INTER, H, dev),
               gemv.plan_gemv(H, INTER, dev, silu_input=True))
    g_ws = gemv.GemvWorkspace.allocate(g_plans, dev)
    rows = []
    for symmetric in (False, True):
        kind = "sym" if symmetric else "asym"
        ws_layers = [(_weight(H, KQ, symmetric, gen), _weight(2 * INTER, H, symmetric, gen),
                      _weight(H, INTER, symmetric, gen)) for _ in range(layers)]
        nbytes = sum(w.nbytes() for w in ws_layers[0])
        norm_w = (1 + 0.1 * torch.randn(H, generator=gen, device="cuda")).to(torch.bfloat16)
        for m in (1, 2):
            attn = torch.randn(m, KQ, generator=gen, device="cuda").to(torch.bfloat16)
            resid0 = torch.randn(m, H, generator=gen, device="cuda").to(torch.bfloat16)
            resid = resid0.clone()
            gate_up = torch.empty(m, 2 * INTER, dtype=torch.bfloat16, device="cuda")
            stats128 = torch.empty(gemv.norm_stats_shape(m, H), dtype=torch.float32, device="cuda")

            def gemv_layer(i, attn=attn, resid=resid, gate_up=gate_up, stats=stats128, ws_layers=ws_layers,
                           norm_w=norm_w):
                w_o, w_gu, w_d = ws_layers[i % layers]
                gemv.gemv_int4(attn, w_o, None, None, g_ws, g_plans[0],
                               residual=gemv.ResidualEpilogue(resid, stats))
                gemv.gemv_int4(resid, w_gu, gate_up, None, g_ws, g_plans[1],
                               norm=gemv.NormPrologue(norm_w, stats, EPS))
                gemv.gemv_int4(gate_up, w_d, None, None, g_ws, g_plans[2], silu_mul_input=True,
                               residual=gemv.ResidualEpilogue(resid, stats))

            resid.copy_(resid0)
            gemv_layer(0)
            want_resid, want_gu = resid.clone(), gate_up.clone()
            t = time_graph(gemv_layer, reps=layers)
            rows.append({"path": "gemv", "kind": kind, "m": m, "us": t * 1e6,
                         "frac_read": nbytes / t / read_bps})
            print(f"gemv        {kind:4s} M={m} {t * 1e6:8.2f} us/layer {rows[-1]['frac_read']:6.1%}",
                  flush=True)
            for name in builds:
                family = "block" if name == "default" else f"block_{name}"
                plan = block.plan_post_attention(H, INTER, KQ, dev, family=family)
                b_ws = block.BlockWorkspace.allocate(plan, dev)
                stats16 = torch.empty(block.stats_shape(m, H), dtype=torch.float32, device="cuda")

                def block_layer(i, attn=attn, resid=resid, gate_up=gate_up, stats=stats16, plan=plan,
                                b_ws=b_ws, ws_layers=ws_layers, norm_w=norm_w):
                    w_o, w_gu, w_d = ws_layers[i % layers]
                    block.post_attention_block(attn, w_o, norm_w, EPS, w_gu, w_d, resid, gate_up, stats, b_ws,
                                               plan)

                resid.copy_(resid0)
                gate_up.fill_(float("nan"))
                block_layer(0)
                torch.cuda.synchronize()
                err_r = float((resid.float() - want_resid.float()).norm() /
                               (want_resid.float() - resid0.float()).norm())
                err_g = float((gate_up.float() - want_gu.float()).norm() / want_gu.float().norm())
                if not (err_r < 1e-2 and err_g < 1e-2):
                    raise SystemExit(f"block {name} {kind} M={m}: wrong outputs (residual update rel. error "
                                     f"{err_r:.3g}, gate_up {err_g:.3g})")
                t = time_graph(block_layer, reps=layers)
                rows.append({"path": f"block:{name}", "build": BUILDS[name], "kind": kind, "m": m,
                             "us": t * 1e6, "frac_read": nbytes / t / read_bps, "err_resid": err_r,
                             "err_gate_up": err_g})
                print(f"block:{name:8s} {kind:4s} M={m} {t * 1e6:8.2f} us/layer {rows[-1]['frac_read']:6.1%}",
                      flush=True)
        ws_layers = None
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "read_bytes_per_s": read_bps, "layers": layers,
              "bytes_per_layer": nbytes, "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "block_ab.json").write_text(json.dumps(result, indent=1))
    (out_dir / "block_ab.md").write_text(report(result))
    return result


def report(r: dict) -> str:
    lines = [f"# Post-attention block: one launch against three GEMVs ({r['device']})\n",
             f"Read bandwidth {r['read_bytes_per_s'] / 1e9:.0f} GB/s; {r['bytes_per_layer'] / 1e6:.1f} MB of "
             f"weights per layer; {r['layers']} layers per graph.\n",
             "| path | kind | M | us / layer | of read BW | vs gemv |", "|---|---|---|---|---|---|"]
    base = {(x["kind"], x["m"]): x["us"] for x in r["rows"] if x["path"] == "gemv"}
    for x in r["rows"]:
        lines.append(f"| {x['path']} | {x['kind']} | {x['m']} | {x['us']:.2f} | {x['frac_read']:.1%} | "
                     f"{x['us'] / base[(x['kind'], x['m'])]:.3f} |")
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
